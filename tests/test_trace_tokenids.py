"""trace/tokenids.py: the pad and eos ids a model states, from its config, its attributes and its embedding."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from maskcli.trace.tokenids import token_ids


class Model(nn.Module):
    def __init__(self, pad, eos, vocab=10):
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=pad, eos_token_id=eos)
        self.embed = nn.Embedding(vocab, 4, padding_idx=pad)


class Wrapper(nn.Module):
    """A module of the program's own around models (NV-Embed's embedder): no config of its own."""

    def __init__(self, *models):
        super().__init__()
        self.models = nn.ModuleList(models)


def test_a_wrapper_states_the_ids_of_the_model_it_wraps():
    """pad == eos, as NV-Embed sets it: the wrapper's rows end in an EOS at the pad id, real, which only the eos id
    read through the wrapped model's config tells apart (quiet-r153a's false alarm before)."""
    assert token_ids(Wrapper(Model(pad=2, eos=2))) == {"pad_id": 2, "eos_id": 2}


def test_a_wrapper_of_models_that_disagree_states_only_its_embedding():
    """A vision tower's config and a text model's that state different ids: neither speaks for the wrapper, whose
    pad id is then its first embedding's padding_idx."""
    assert token_ids(Wrapper(Model(pad=0, eos=5), Model(pad=1, eos=3))) == {"pad_id": 0}


def test_a_model_with_its_own_config_reads_it():
    assert token_ids(Model(pad=0, eos=7)) == {"pad_id": 0, "eos_id": 7}
