"""Copy trained drafts into the package and write each RECIPE.md from the runs' own
records (train_config.json, log.jsonl): no hand-typed figures.

DFlash / DSpark drafts are shipped in their z-lab / DeepSpec layouts, the EAGLE-3 draft in the
`LlamaForCausalLMEagle3` layout vLLM and SGLang read (bf16 safetensors with d2t / t2d, as
`blockspec train --method eagle3` saves it).

A draft trained in stages (`--init-from` an earlier run's draft) is traced back
through the run directories beside it; every stage gets a row and its own
held-out tau curve. A first stage that continued a shipped draft (`--init-from
src/blockspec/assets/NAME`) keeps that draft's recorded stages, copied from its RECIPE.md.

    python recipes/ship_drafts.py --dflash runs/gpu1/dflash4c --dspark runs/gpu1/dspark4c \
        --data runs/gpu1/regen_train.jsonl.gz
    python recipes/ship_drafts.py --eagle3 runs/eagle3
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "blockspec" / "assets"

CPU_COMMANDS = {
    "dflash": """```bash
bash recipes/train_drafts.sh     # regenerate data with the target, then train both drafts (CPU)
python recipes/ship_drafts.py --dflash runs/dflash3 --dspark runs/dspark3
```""",
    "eagle3": """```bash
bash recipes/train_drafts.sh eagle3    # regenerate data with the target (once), then train the draft (CPU)
bash recipes/train_drafts.sh eagle3b   # its second stage, from runs/eagle3/draft
python recipes/ship_drafts.py --eagle3 runs/eagle3b
```
`--time-budget-s` fits the step count to the wall-time budget after timing the first 20 steps,
so a rerun on other hardware (or beside other work) takes a different number of steps.""",
}
CPU_COMMANDS["dspark"] = CPU_COMMANDS["dflash"]
LAYOUTS = {"dflash": "z-lab DFlash (`DFlashDraftModel`)", "dspark": "DeepSpec DSpark (`Qwen3DSparkModel`)",
           "eagle3": "EAGLE-3 (`LlamaForCausalLMEagle3`, as vLLM and SGLang read it)"}
GPU_COMMANDS = {"dflash": """```bash
bash recipes/train_drafts_gpu.sh prepare            # CPU machine: corpus, first 4000 examples, HumanEval prompts
bash recipes/train_drafts_gpu.sh regen train bench  # GPU machine (carry .gpu/), one call
bash recipes/train_drafts_gpu.sh more1              # then, in the same machine's runs/gpu
bash recipes/train_drafts_gpu.sh more2
python recipes/ship_drafts.py --dflash RUNS/dflash4c --dspark RUNS/dspark4c --data RUNS/regen_train.jsonl.gz
```
The first 4000 examples of the data are `recipes/train_drafts.sh`'s (CPU, same prompts and
seed), carried to the GPU machine by `prepare`; `--time-budget-s` fits each stage's step count to its wall-time budget after timing
its first 20 steps, so a rerun on other hardware takes a different number of steps: pass
`--max-steps` with the counts in the table above to repeat them exactly.""",
                "eagle3": """```bash
bash recipes/train_drafts_gpu.sh prepare      # CPU machine: the first 4000 examples, HumanEval prompts -> .gpu/
bash recipes/train_eagle3_gpu.sh              # GPU machine (carry .gpu/): three stages, then the bench
python recipes/ship_drafts.py --eagle3 RUNS/eagle3c --data RUNS/regen/train.jsonl
```"""}
GPU_COMMANDS["dspark"] = GPU_COMMANDS["dflash"]


def earlier_stage(run: Path) -> Path | None:
    """The stage the run continued: its `init_from` itself where that is a kept stage (a committed
    campaign draft with its log and config), else the run directory beside it that saved that draft
    (`runs/x/draft` -> `runs/x`, also when the runs came from another machine)."""
    init = json.loads((run / "train_config.json").read_text()).get("init_from")
    if not init:
        return None
    for candidate in (Path(init), run.parent / Path(init).parent.name):
        if (candidate / "train_config.json").is_file() and (candidate / "log.jsonl").is_file():
            return candidate
    return None


def stages(run: Path) -> list[Path]:
    """The run and the earlier runs it continued from, oldest first."""
    chain = [run]
    while (earlier := earlier_stage(chain[0])) is not None and earlier not in chain:
        chain.insert(0, earlier)
    return chain


def campaign_of(chain: list[Path]) -> Path | None:
    """The campaign directory (`recipes/campaign/PAIR`) of the chain's latest committed stage, if any."""
    return next((run.parent for run in reversed(chain) if run.parent.parent.name == "campaign"), None)


def label(run: Path) -> str:
    """A stage's name in the records: committed campaign stages keep their pair's name."""
    return f"{run.parent.name}/{run.name}" if run.parent.parent.name == "campaign" else run.name


def shipped_record(init_from: str | None) -> dict[str, list[str]]:
    """The recorded stages of a shipped draft that the first stage continued (its RECIPE.md's stage
    rows, tau curves and exact configs, as written by `recipe_text`); empty lists for anything else."""
    record: dict[str, list[str]] = {"rows": [], "curves": [], "configs": []}
    recipe = Path(init_from) / "RECIPE.md" if init_from else None
    if recipe is None or not recipe.is_file():
        return record
    text = recipe.read_text()
    table = text.split(STAGE_HEADER, 1)[1].split("\n\n", 1)[0] if STAGE_HEADER in text else ""
    record["rows"] = [line for line in table.splitlines() if line.startswith("| ")]
    curves = text.split("step: tau per stage:", 1)[1].split("\n## ", 1)[0] if "step: tau per stage:" in text else ""
    record["curves"] = [line[2:] for line in curves.splitlines() if line.startswith("- ")]
    if "## Exact training configs" in text:
        record["configs"] = [text.split("## Exact training configs", 1)[1].strip()]
    if not (record["rows"] and record["curves"] and record["configs"]):
        raise SystemExit(f"error: {recipe} has no stage table, tau curves and configs as recipe_text writes them")
    return record


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in open(run / "log.jsonl")]


def count_lines(path: Path) -> int:
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        return sum(1 for _ in f)


STAGE_HEADER = """| stage | device | starts from | steps | wall time (s) | lr | seed | final loss | final held-out tau |
|---|---|---|---|---|---|---|---|---|"""


def stage_row(run: Path) -> str:
    cfg = json.loads((run / "train_config.json").read_text())
    log = read_log(run)
    evals = [r["eval"]["tau"] for r in log if "eval" in r]
    start = ("warm start from the target's last layers" if cfg.get("init_from_target") and not cfg.get("init_from")
             else f"`{cfg['init_from']}`" if cfg.get("init_from") else "random init")
    return (f"| {label(run)} | {cfg['device']} | {start} | {log[-1]['step']} | {log[-1]['time_s']} | "
            f"{cfg['lr']} | {cfg['seed']} | {log[-1]['loss']} | {evals[-1] if evals else 'n/a'} |")


def eval_curve(run: Path) -> str:
    """`name: step: tau, ...`: the run's held-out greedy tau at each evaluation."""
    return f"{label(run)}: " + ", ".join(f"{r['step']}: {r['eval']['tau']:.3f}" for r in read_log(run) if "eval" in r)


def shape_line(name: str, draft_cfg: dict, train_cfg: dict) -> str:
    """The draft's shape in one line, in its own format's terms."""
    if name == "eagle3":
        aux = draft_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        return (f"{draft_cfg['num_hidden_layers']} layer(s), auxiliary target layers {aux}, draft vocabulary "
                f"{draft_cfg['draft_vocab_size']} of {draft_cfg['vocab_size']}, trained with a "
                f"{train_cfg['ttt_steps']}-step training-time test (chains of {train_cfg['ttt_steps']} drafts in "
                "the tau below)")
    return (f"block_size {draft_cfg['block_size']}, {draft_cfg['num_hidden_layers']} layer(s), target_layer_ids "
            f"{draft_cfg.get('dflash_config', draft_cfg).get('target_layer_ids')}")


def init_note(name: str, train_cfg: dict) -> str:
    if name == "eagle3":
        return ("Initialisation: random (an EAGLE-3 layer reads [embedding ; fc(features)], 2H wide: no target "
                "layer has its shape); the embedding is the target's, read at run time, not shipped. Draft "
                "vocabulary: the most frequent trained tokens of the data (d2t / t2d in the weights).")
    return ("Warm start (`init_from_target`): draft layer i starts as a copy of target layer\n"
            "L-n+i (the last n layers), `fc` passes the deepest captured feature through.")


def commands_text(name: str, chain: list[Path], held_out: int) -> str:
    """The Commands section: a campaign's stages point to its README (their exact lines, the data's
    regeneration and the target's), other drafts to the recipe scripts that made them."""
    campaign = campaign_of(chain)
    if campaign is not None:
        return (f"Every stage's command, the regeneration of the data and the target's own recipe are in\n"
                f"`{campaign}/README.md`, next to the committed stages this draft continued. The first\n"
                f"{held_out} examples of the data are held out for the tau above.")
    gpu = any(json.loads((r / "train_config.json").read_text())["device"] != "cpu" for r in chain)
    return f"""{(GPU_COMMANDS if gpu else CPU_COMMANDS)[name]}

Data: `blockspec regenerate --prompts runs/corpus --seed 0 --max-new-tokens 160 ...`: random
code prefixes from the corpus' training split, continued greedily by the target; the
first {held_out} examples are held out for the tau above."""


def recipe_text(name: str, chain: list[Path], dest: Path, n_examples: int, history: str = "") -> str:
    draft_cfg = json.loads((dest / "config.json").read_text())
    size_mb = sum(f.stat().st_size for f in dest.glob("*.safetensors")) / 1e6
    first = json.loads((chain[0] / "train_config.json").read_text())
    shipped = shipped_record(first.get("init_from"))
    again = [label(run) for run in chain if any(row.startswith(f"| {label(run)} |") for row in shipped["rows"])]
    if again:
        raise SystemExit(f"error: {first['init_from']}/RECIPE.md already records {', '.join(again)}: restore the "
                         "RECIPE.md of the draft that run continued (git checkout) before shipping it again")
    curves, configs = list(shipped["curves"]), list(shipped["configs"])
    for run in chain:
        cfg = json.loads((run / "train_config.json").read_text())
        curves.append(eval_curve(run))
        configs.append(f"{label(run)}:\n```json\n{json.dumps(cfg, indent=2)}\n```")
    stage_rows = "\n".join(shipped["rows"] + [stage_row(run) for run in chain])
    curve_lines = "\n".join(f"- {c}" for c in curves)
    config_text = "\n\n".join(configs)
    return f"""# Embedded {name} draft: recipe

{LAYOUTS[name]} layout, trained by `blockspec train` for the embedded target
(`../target`). {shape_line(name, draft_cfg, first)}, {size_mb:.1f} MB of bf16 weights.

## Training record (from the runs' logs)

Trained in {len(shipped["rows"]) + len(chain)} stage(s), each continuing the one above it:

{STAGE_HEADER}
{stage_rows}

Training examples (target-regenerated): {n_examples}. Held-out greedy tau during training
({first['eval_examples']} held-out examples, {first['eval_new_tokens']} new tokens, tau includes the bonus
token), step: tau per stage:

{curve_lines}

## Commands

{commands_text(name, chain, first['eval_examples'])}

{init_note(name, first)}
{f"{chr(10)}History: {history}{chr(10)}" if history else ""}
## Exact training configs

{config_text}
"""


def ship(run: Path, name: str, data: Path, history: str = "", assets: Path = ASSETS) -> None:
    chain = stages(run)
    dest = assets / name
    # Written next to the old draft first: a stage continuing the shipped draft reads its RECIPE.md.
    staging = assets / f".{name}.new"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(run / "draft", staging)
    try:
        (staging / "RECIPE.md").write_text(recipe_text(name, chain, staging, count_lines(data), history))
    except BaseException:
        shutil.rmtree(staging)
        raise
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    print(f"shipped {name} from {run}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dflash", type=Path, help="run directory of the DFlash draft to ship")
    ap.add_argument("--dspark", type=Path, help="run directory of the DSpark draft to ship")
    ap.add_argument("--eagle3", type=Path, help="run directory of the EAGLE-3 draft to ship")
    ap.add_argument("--data", type=Path, default=Path("runs/regen2/train.jsonl"),
                    help="the training data (jsonl or jsonl.gz), for its example count")
    ap.add_argument("--history", default="",
                    help="a paragraph on how and where the run was made (machine, what it compares with)")
    ap.add_argument("--summary", type=Path, nargs="+", metavar="RUN",
                    help="only print the stage table and held-out tau curve of these runs (and the machine of their env.txt)")
    args = ap.parse_args()
    if args.summary:
        for parent in sorted({run.parent for run in args.summary}):
            for name in ("env.txt", "phases.log"):
                if (parent / name).is_file():
                    print(f"{parent / name}: " + " | ".join(line.strip() for line in (parent / name).open()))
        for run in args.summary:
            print(f"\n{run}:\n\n{STAGE_HEADER}\n" + "\n".join(stage_row(r) for r in stages(run)))
            print("\nHeld-out greedy tau by step:\n\n" + "\n".join(f"- {eval_curve(r)}" for r in stages(run)))
        return
    if not (args.dflash or args.dspark or args.eagle3):
        ap.error("name at least one of --dflash / --dspark / --eagle3")
    for name, run in (("dflash", args.dflash), ("dspark", args.dspark), ("eagle3", args.eagle3)):
        if run is not None:
            ship(run, name, args.data, args.history)


if __name__ == "__main__":
    main()
