"""checks/fieldnames.py: a window stated under Transformer-XL's and llama.cpp's field names, read through
checks/intent.fields_of (what every config the program keeps goes through)."""

from __future__ import annotations

import enum

from hypothesis import given
from hypothesis import strategies as st

from maskcli.checks.intent import fields_of


class SwaType(enum.Enum):  # (llama.cpp's llama_swa_type, as a port may keep it)
    NONE = 0
    STANDARD = 1
    CHUNKED = 2


def test_llamacpp_standard_swa_is_a_window_and_its_layers():
    found = fields_of({"n_swa": 512, "swa_type": 1, "swa_layers": [True, True, False]})
    assert found["sliding_window"] == 512 and found["window_said"] == "n_swa"
    assert found["sliding_window_layers"] == [True, True, False] and found["layers_said"] == "swa_layers"
    assert fields_of({"n_swa": 8, "swa_type": SwaType.STANDARD})["sliding_window"] == 8
    assert fields_of({"n_swa": 8})["sliding_window"] == 8  # (a port that keeps n_swa alone)


def test_llamacpp_chunked_or_no_swa_is_no_window():
    """LLAMA_SWA_TYPE_CHUNKED's n_swa is Llama 4's chunk size; NONE slides not at all; 0 is no window."""
    for kind in (0, 2, SwaType.NONE, SwaType.CHUNKED):
        assert "sliding_window" not in fields_of({"n_swa": 8192, "swa_type": kind, "n_layer": 4})
    assert "sliding_window" not in fields_of({"n_swa": 0, "swa_type": 1, "n_layer": 4})


def test_the_library_name_wins_over_another_projects():
    found = fields_of({"sliding_window": 4, "n_swa": 9, "swa_type": 1})
    assert found["sliding_window"] == 4 and "window_said" not in found


def test_transformer_xl_same_length_memory_is_a_window():
    assert fields_of({"mem_len": 16, "same_length": True})["sliding_window"] == 16
    assert "sliding_window" not in fields_of({"mem_len": 16, "same_length": False, "n_layer": 2})


@given(st.integers(min_value=1, max_value=10**6), st.lists(st.booleans(), min_size=1, max_size=8))
def test_any_standard_window_and_bool_layers_read_as_given(window, layers):
    found = fields_of({"n_swa": window, "swa_type": 1, "swa_layers": layers})
    assert found["sliding_window"] == window and found["sliding_window_layers"] == layers
