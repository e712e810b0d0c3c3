"""tensorfile/pt.py: a .pt or .pth file read with torch.load(weights_only=True), so that nothing in it is run; what is
not a tensor or a dict of tensors is refused naming it."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from maskcli.errors import MaskError
from maskcli.tensorfile.base import Reading
from maskcli.tensorfile.pt import read
from tensorfile_cli import refused


def test_a_tensor_and_a_dict_of_tensors_come_back_as_torch_saved_them(tmp_path):
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    torch.save(keep, tmp_path / "m.pt")
    assert list(read(tmp_path / "m.pt", "m")) == [""] and torch.equal(read(tmp_path / "m.pt", "m")[""], keep)
    scores = torch.randn(2, 3, dtype=torch.bfloat16)
    torch.save({"mask": keep, "scores": scores}, tmp_path / "two.pth")
    got = read(tmp_path / "two.pth", "two")
    assert torch.equal(got["mask"], keep) and got["scores"].dtype == torch.bfloat16 and torch.equal(got["scores"], scores)


def test_plain_numbers_become_tensors_only_when_asked_and_lists_are_kept_as_lists(tmp_path):
    torch.save({"cu_seqlens_q": torch.tensor([0, 3, 5]), "max_length_q": 3, "choices": [[0], [0, 1]]}, tmp_path / "b.pt")
    with pytest.raises(MaskError, match=r"entry 'max_length_q' of the dict is int 3, not a tensor; save only tensors"):
        read(tmp_path / "b.pt", "b")
    got = read(tmp_path / "b.pt", "b", Reading(numbers=True, lists=("choices",)))
    assert torch.equal(got["max_length_q"], torch.tensor(3)) and got["choices"] == [[0], [0, 1]]


class Planter:
    """A pickle whose loading would run code: unpickling it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_would_run_code_is_refused_and_nothing_in_it_runs(tmp_path):
    marker = tmp_path / "planted"
    torch.save({"mask": torch.ones(2, 2), "evil": Planter(marker)}, tmp_path / "dict.pt")
    torch.save(Planter(marker), tmp_path / "bare.pt")
    (tmp_path / "raw.pt").write_bytes(pickle.dumps(Planter(marker)))  # a legacy pickle, not torch.save's zip
    for name in ("dict", "bare"):  # torch's unpickler names the global it refuses
        with pytest.raises(MaskError, match=r"refused to load with weights_only=True, nothing in it was run \(.*open"):
            read(tmp_path / f"{name}.pt", name)
    with pytest.raises(MaskError, match=r"raw: refused to load with weights_only=True, nothing in it was run"):
        read(tmp_path / "raw.pt", "raw")
    refused(["show", "--mask", tmp_path / "dict.pt"], "refused to load with weights_only=True", "torch.save(tensor, path)")
    assert not marker.exists()
    pickle.loads((tmp_path / "raw.pt").read_bytes()).close()  # the reference: plain pickle does run it
    assert marker.exists()


def test_what_is_no_tensor_is_refused_saying_what_it_is(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(MaskError, match=r"holds list \[1, 2, 3\], not a tensor or a dict of tensors"):
        read(tmp_path / "list.pt", "list")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "prototype stage" warning of the strided layout
        nested = torch.nested.nested_tensor([torch.ones(2, 2), torch.ones(3, 3)])
    torch.save({"m": nested}, tmp_path / "nested.pt")
    with pytest.raises(MaskError, match=r"entry 'm' is a nested tensor"):
        read(tmp_path / "nested.pt", "nested")
    (tmp_path / "zipped.pt").write_bytes(b"PK\x03\x04 broken zip")
    refused(["show", "--mask", tmp_path / "zipped.pt"], "not a readable .pt file")
    torch.save({"only": [[0]]}, tmp_path / "lists.pt")
    with pytest.raises(MaskError, match=r"holds only only, no tensors"):
        read(tmp_path / "lists.pt", "lists", Reading(lists=("only",)))
