"""models/attention.py, the one place an attention function goes into a transformers model: installers of
different names nest (each puts back what it found), a second install of one name keeps the first previous
implementation, uninstalling a name never installed changes nothing, and a routed block restores on raise."""

from __future__ import annotations

from contextvars import ContextVar

import pytest
import torch

from sparsesearch.models import load_model
from sparsesearch.models.attention import install, register, routed, text_attention, uninstall
from tiny_model import make_tiny_model


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny")), dtype="float32", device="cpu")[0]


def test_installers_nest_and_put_back_what_they_found(model):
    assert text_attention(model) == "sdpa"
    install(model, "first_fn", _sdpa)
    install(model, "second_fn", _sdpa)
    install(model, "second_fn", _sdpa)  # again: its previous stays "first_fn", not itself
    assert text_attention(model) == "second_fn"
    ids = torch.arange(8)[None]
    with torch.no_grad():
        model(input_ids=ids)  # the registered function really serves the forward
    uninstall(model, "second_fn")
    assert text_attention(model) == "first_fn"
    uninstall(model, "second_fn")  # never installed any more: nothing changes
    assert text_attention(model) == "first_fn"
    uninstall(model, "first_fn")
    assert text_attention(model) == "sdpa" and not [a for a in vars(model) if a.startswith("_sparsesearch_previous")]


def test_routed_restores_on_raise(model):
    var: ContextVar = ContextVar("test_routed", default=None)
    register("routed_fn", _sdpa)
    with pytest.raises(RuntimeError, match="boom"):
        with routed(model, "routed_fn", var, 7):
            assert text_attention(model) == "routed_fn" and var.get() == 7
            raise RuntimeError("boom")
    assert text_attention(model) == "sdpa" and var.get() is None
