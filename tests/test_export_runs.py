"""The torch formats' printed calls run as printed (issue 28.5): sdpa, mha and flex executed on the CPU, hf on tiny
random-weight models; and the release each call is written for. The GPU libraries' calls: test_export_gpu_calls.py."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()


def printed(*args) -> str:
    result = runner.invoke(app, ["export", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.stdout


def pad_rows(ids: str) -> list[list[bool]]:
    return [[int(x) != 0 for x in row.split(",")] for row in ids.split(";")]


# --- Hugging Face: tiny random-weight models, run as printed ----------------------------------------


def tiny_model(family: str):
    """A random-weight model built from its config (no download): Llama (rotary positions, which only differences of
    positions reach) or GPT-2 (learned absolute positions, which position_ids change)."""
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=64)).eval()
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


HF = [  # (flags, keep(b, q, kv) of the new queries on absolute positions, offset, total length, ids)
    (["window(3)", "--len", 2, "--offset", 5], lambda b, q, kv: q - 3 < kv <= q, 5, 7, None),
    (["causal", "--len", 1, "--offset", 5, "--ids", "0,0,5,6,7,8;1,2,3,4,5,6"], lambda b, q, kv: kv <= q, 5, 6, "0,0,5,6,7,8;1,2,3,4,5,6"),
    (["document(sizes=[2,3])"], lambda b, q, kv: (q < 2) == (kv < 2) and kv <= q, 0, 5, None),
    (["causal", "--len", 4, "--lengths", "4,2", "--pad", "left"], lambda b, q, kv: kv <= q, 0, 4, "1,1,1,1;0,0,1,1"),
]


def rotary_positions(valid: list[list[bool]], documents: list[int] | None) -> torch.Tensor:
    """Each token's position, by a loop: its place in its document, or the real tokens before it in its row (0 at a
    pad), as generate() makes them (transformers 5.24, generation/utils.py:919-921)."""
    out = []
    for row in valid:
        at, seen, label = [], 0, None
        for p, real in enumerate(row):
            if documents is not None:
                seen = 0 if documents[p] != label else seen
                label = documents[p]
            at.append(seen if real else 0)
            seen += real
        out.append(at)
    return torch.tensor(out)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("flags, keep, offset, total, ids", HF, ids=[" ".join(map(str, c[0])) for c in HF])
def test_the_printed_hf_call_runs_on_a_tiny_model(tmp_path, family, flags, keep, offset, total, ids):
    """issue 28.4: behind a cache the call prints the cache its 4-D mask counts (it printed none: a size error). The
    reference runs the whole sequence at once with a 4-D mask and positions written by loops: the cached rows causal
    (what the fill call's model mask is) and the padding masked, the new rows by the rule; transformers 5.24 uses a
    4-D mask as given (masking_utils.py:817-819, _preprocess_mask_arguments returns it as-is). Left-padded rows get
    the positions generate() gives them (they started late)."""
    model = tiny_model(family)
    path = tmp_path / "hf.pt"
    code = printed(*flags, "--for", "hf", "--save", path)
    valid = [[True] * total] if ids is None else pad_rows(ids)
    batch = len(valid)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (batch, total), generator=g)
    scope = {"model": model, "input_ids": tokens[:, offset:], "past_ids": tokens[:, :offset]}
    with torch.no_grad():
        exec(code, scope)  # as printed
        positions = rotary_positions(valid, [0, 0, 1, 1, 1] if "document" in flags[0] else None)
        cells = torch.tensor([[[[valid[b][kv] and (keep(b, q, kv) if q >= offset else kv <= q) for kv in range(total)] for q in range(total)]]
                              for b in range(batch)])
        whole = model(tokens, attention_mask=torch.where(cells, 0.0, torch.finfo(torch.float32).min), position_ids=positions)
    assert torch.allclose(scope["out"].logits, whole.logits[:, offset:], atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_printed_hf_call_for_a_draft_tree_gives_each_node_its_own_path(tmp_path, family):
    """A draft tree behind a cache: run as printed, each node's logits are those of decoding its own path (the cached
    tokens, its ancestors, itself) as one plain causal sequence. Without the depth positions the call printed none:
    siblings got different positions (rotary in Llama, learned in GPT-2) and node 2 read as if it were third."""
    parents, offset = [-1, 0, 0, 1], 3
    model = tiny_model(family)
    path = tmp_path / "hf.pt"
    code = printed(f"tree({','.join(map(str, parents))})", "--offset", offset, "--for", "hf", "--save", path)
    tokens = torch.randint(0, 32, (1, offset + len(parents)), generator=torch.Generator().manual_seed(2))
    scope = {"model": model, "input_ids": tokens[:, offset:], "past_ids": tokens[:, :offset]}
    with torch.no_grad():
        exec(code, scope)  # as printed
        for node in range(len(parents)):
            line = [node]
            while parents[line[-1]] >= 0:  # up to the root, by the parents as written
                line.append(parents[line[-1]])
            sequence = torch.cat([tokens[:, :offset], tokens[:, [offset + i for i in reversed(line)]]], dim=1)
            alone = model(sequence).logits[0, -1]
            assert torch.allclose(scope["out"].logits[0, node], alone, atol=1e-5), node


def test_an_hf_mask_on_keys_a_model_does_not_hold_is_refused():
    result = runner.invoke(app, ["export", "causal", "--len", "2", "--kv-len", "5", "--for", "hf"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("maskcli: error: a Hugging Face model's keys are the tokens before its queries and the queries themselves "
                                     "(0-1), and this mask's are keys 0-4: drop --kv-start and --kv-len, or use --for sdpa")


# --- which release each call is written for --------------------------------------------------------


def test_each_call_names_the_release_it_is_written_for_and_the_docs_list_the_same():
    """issue 28.3: the output and docs/export.md's table say, per format, which library version the call is for."""
    from pathlib import Path

    from maskcli.formats.registry import formats

    table = {}
    page = (Path(__file__).parent.parent / "docs" / "export.md").read_text()
    for names, version in re.findall(r"^\| ([a-z, -]+) \| ([A-Za-z_]+ [\d.]+)", page, re.M):
        table.update({name.strip(): version for name in names.split(",")})
    for fmt in formats().values():
        assert table[fmt.name] == fmt.version
        assert printed("document(sizes=[3,5])", "--for", fmt.name).splitlines()[1] == f"# written for {fmt.version}"


def test_magi_call_has_no_max_seqlen_k():
    """MagiAttention 1.1.1's flex_flash_attn_func has no max_seqlen_k (functional/flex_flash_attn.py:1059-1088); 1.0.4
    dropped both max_seqlen arguments, 1.1.0 brought back an optional max_seqlen_q: the call passes neither."""
    code = printed("document(sizes=[3,5]) & window(2)", "--for", "magi")
    assert "out, meta = flex_flash_attn_func(q, k, v, q_ranges=t['q_ranges'], k_ranges=t['k_ranges'], attn_type_map=attn_type_map)" in code
    assert "max_seqlen" not in code


# --- torch formats: sdpa, mha, flex executed here ---------------------------------------------------------------

TORCH = [  # (flags, keep(b, q, kv) on absolute positions, query positions, key positions, real tokens per batch row)
    (["causal", "--len", 5], lambda b, q, kv: kv <= q, (0, 5), (0, 5), None),
    (["causal", "--len", 2, "--offset", 3], lambda b, q, kv: kv <= q, (3, 5), (0, 5), None),
    (["causal", "--len", 3, "--offset", 2, "--kv-start", 1], lambda b, q, kv: kv <= q, (2, 5), (1, 5), None),
    (["causal", "--len", 4, "--kv-len", 6], lambda b, q, kv: kv <= q, (0, 4), (0, 6), None),  # sdpa: is_causal, top-left
    (["causal", "--len", 6, "--kv-len", 4], lambda b, q, kv: kv <= q, (0, 6), (0, 4), None),
    (["window(2)", "--len", 4, "--lengths", "4,2", "--pad", "left"], lambda b, q, kv: q - 2 < kv <= q, (0, 4), (0, 4), "1,1,1,1;0,0,1,1"),
    (["causal", "--len", 4, "--ids", "1,2,3,0;1,2,0,0"], lambda b, q, kv: kv <= q, (0, 4), (0, 4), "1,2,3,0;1,2,0,0"),
    (["document(sizes=[2,3])"], lambda b, q, kv: (q < 2) == (kv < 2) and kv <= q, (0, 5), (0, 5), None),
]


def torch_reference(keep, q_range, k_range, ids) -> torch.Tensor:
    valid = None if ids is None else pad_rows(ids)
    batch = 1 if valid is None else len(valid)
    return torch.tensor([[[[(valid is None or valid[b][kv]) and keep(b, q, kv) for kv in range(*k_range)] for q in range(*q_range)]]
                         for b in range(batch)])


def attention(q, k, v, keep):
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v


# flex_attention on the CPU takes about a second a call: it runs the cases the other tests leave (behind a cache that
# dropped its first keys, ids padding); test_command_export runs it on left padding, test_formats on packed documents
RUNS = [(fmt, *case) for case in TORCH for fmt in ("sdpa", "mha", "flex") if fmt != "flex" or {"--kv-start", "--ids"} & set(case[0])]


@pytest.mark.parametrize("fmt, flags, keep, q_range, k_range, ids", RUNS, ids=[f"{c[0]} {' '.join(map(str, c[1]))}" for c in RUNS])
def test_the_printed_torch_call_runs_and_is_the_mask(tmp_path, fmt, flags, keep, q_range, k_range, ids):
    """The printed call executed as printed (with --save where it reads tensors), its output against attention under a
    mask written by a loop over absolute positions (rows that see no key left out: NaN or 0 by backend)."""
    want = torch_reference(keep, q_range, k_range, ids)
    batch, _, lq, lk = want.shape
    path = tmp_path / "m.pt"
    result = runner.invoke(app, ["export", *map(str, flags), "--for", fmt, "--save", str(path)])
    if result.exit_code == 2 and "needs no tensors" in result.stderr:
        result = runner.invoke(app, ["export", *map(str, flags), "--for", fmt])
    assert result.exit_code == 0, result.output
    g = torch.Generator().manual_seed(0)
    seen = want.any(-1)  # (B, 1, Lq)
    if fmt == "mha":
        torch.manual_seed(0)
        query, key = torch.randn(batch, lq, 8, generator=g), torch.randn(batch, lk, 8, generator=g)
        scope = {"embed_dim": 8, "query": query, "key": key, "value": key}
        exec(result.stdout, scope)
        with torch.no_grad():  # the same module, given the loop's mask as one (B * heads, Lq, Lk) block mask, True = masked
            expected, _ = scope["mha"](query, key, key, attn_mask=~want[:, 0])
        assert torch.allclose(scope["out"][seen[:, 0]], expected[seen[:, 0]], atol=1e-5)
        return
    q = torch.randn(batch, 1, lq, 8, generator=g)
    k, v = (torch.randn(batch, 1, lk, 8, generator=g) for _ in range(2))
    scope = {"q": q, "k": k, "v": v}
    exec(result.stdout, scope)  # as printed
    assert torch.allclose(scope["out"][seen], attention(q, k, v, want)[seen], atol=1e-5)
