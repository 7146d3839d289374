"""blockspec.loading: the library's model loading (embedded models by default)."""

from __future__ import annotations

import pytest

from blockspec import embedded
from blockspec.errors import BlockspecError
from blockspec.loading import draft_kind, load_drafts, load_models


def test_draft_kind():
    assert [draft_kind(m) for m in ("ar", "hf", "dflash", "dspark", "dspark-scheduled")] == \
        [None, None, "dflash", "dspark", "dspark"]


def test_load_models_ar_has_no_draft():
    models = load_models()
    assert models.draft is None and models.method == "ar"
    assert models.tokenizer.encode("def f():")
    assert models.target.config.vocab_size >= len(models.tokenizer.encode("def f():"))


def test_load_models_shorter_block_is_a_new_draft():
    full = load_models(method="dspark").draft
    short = load_models(method="dspark", block_size=2).draft
    assert short.config.block_size == 2 and full.config.block_size > 2


def test_load_models_missing_target(tmp_path):
    with pytest.raises(BlockspecError):
        load_models(tmp_path / "missing")


def test_load_drafts_loads_what_the_methods_need():
    target = load_models().target
    assert load_drafts(target, {}, ["ar", "hf"]) == {}
    loaded = load_drafts(target, {"dspark": None}, ["ar", "dspark-scheduled"])
    assert list(loaded) == ["dspark"] and loaded["dspark"].config.is_dspark
    assert set(load_drafts(target, {}, ["dflash", "dspark"])) == {"dflash", "dspark"}


def test_load_drafts_refuses_a_dflash_draft_for_dspark():
    target = load_models().target
    with pytest.raises(BlockspecError, match="neither a Markov nor a confidence head"):
        load_drafts(target, {"dspark": embedded.default_draft("dflash")}, ["dspark"])
