"""maskcli.hf: families from config classes, shrunk keeping what shapes masks, run and traced; each captured mask
against Hugging Face's documented mask rule computed here (a double loop over absolute positions)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may download: configs come from classes or a local file
transformers = pytest.importorskip("transformers", reason="maskcli model needs the hf extra (transformers)")

from maskcli.errors import MaskError  # noqa: E402
from maskcli.hf import families  # noqa: E402
from maskcli.hf.run import prompt, run  # noqa: E402


def reference(valid: np.ndarray, q_pos: list[int], k_pos: list[int], window: int | None = None, chunk: int | None = None) -> np.ndarray:
    """HF's rule on absolute (padded) positions, a double loop: causal, no padding key, a sliding window of W keys
    including itself, Llama 4 chunks counted from each row's first real token. Bool (B, Lq, Lk)."""
    batch = valid.shape[0]
    out = np.zeros((batch, len(q_pos), len(k_pos)), dtype=bool)
    for b in range(batch):
        first = int(np.argmax(valid[b]))
        for i, q in enumerate(q_pos):
            for j, k in enumerate(k_pos):
                keep = k <= q and valid[b, k]
                if window is not None:
                    keep = keep and q - k < window
                if chunk is not None:
                    keep = keep and (q - first) // chunk == (k - first) // chunk
                out[b, i, j] = keep
    return out


def check_against_reference(result, window: int | None = None, chunk: int | None = None) -> int:
    """Every captured call against the reference: queries are the step's positions, keys the last Lk positions
    so far (what a dynamic cache returns); the number of calls checked."""
    ids = result.prompt.attention_mask.numpy().astype(bool)
    steps = len(result.steps)
    valid = np.concatenate([ids, np.ones((ids.shape[0], steps), dtype=bool)], axis=1)
    prompt_len = ids.shape[1]
    checked = 0
    for call in result.calls:
        total = prompt_len + call.step
        q_len, k_len = call.shape[2:]
        assert q_len == (prompt_len if call.step == 0 else 1)
        kind = call.details["layer_type"]
        if kind == "full_attention":
            assert k_len == total
        q_pos = list(range(total - q_len, total))
        k_pos = list(range(total - k_len, total))
        want = reference(valid, q_pos, k_pos, window if kind == "sliding_attention" else None,
                         chunk if kind == "chunked_attention" else None)
        got = np.broadcast_to(call.keep(), call.shape)
        for h in range(call.shape[1]):
            assert (got[:, h] == want).all(), (call.where, call.step, kind, got[:, h].astype(int), want.astype(int))
        checked += 1
    return checked


FAMILIES = [  # (family, window, chunk size, layers, layer types in the tiny model)
    ("llama", None, None, 2, {"full_attention"}),
    ("mistral", 3, None, 2, {"sliding_attention"}),
    ("gemma3_text", 3, None, 6, {"sliding_attention", "full_attention"}),
    ("qwen3", None, None, 2, {"full_attention"}),
]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family, window, chunk, layers, types", FAMILIES)
def test_each_captured_mask_is_hf_rule_on_absolute_positions(family, window, chunk, layers, types, attn):
    config = families.tiny(families.load(family), window=window, chunk_size=chunk, name=family)
    assert config.num_hidden_layers == layers and set(families.layer_types(config)) == types
    batch = prompt((5, 3), None, config.pad_token_id, "left", 128)
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    result = run(family, config, batch, new_tokens=2, attn=attn)
    assert result.steps == ["prefill", "decode 1", "decode 2"]
    assert {call.api for call in result.calls} == {"softmax" if attn == "eager" else "sdpa"}
    assert check_against_reference(result, window, chunk) == 3 * layers


def test_flex_attention_is_captured_though_transformers_compiles_it():
    config = families.tiny(families.load("gemma3_text"), window=2, name="gemma3_text")
    result = run("gemma3_text", config, prompt((4, 2), None, 0, "left", 128), new_tokens=1, attn="flex")
    assert {call.api for call in result.calls} == {"flex"}
    assert check_against_reference(result, window=2) == 12


def test_llama4_chunked_layers_count_chunks_from_the_first_real_token():
    config = families.tiny(families.load("llama4_text"), chunk_size=2, name="llama4_text")
    assert families.layer_types(config) == ["chunked_attention"] * 3 + ["full_attention"]
    result = run("llama4_text", config, prompt((5, 3), None, config.pad_token_id, "left", 128), new_tokens=1, attn="eager")
    assert check_against_reference(result, chunk=2) == 8


def test_a_config_without_layer_types_is_read_as_the_rules_read_it_and_as_its_class_fills_them():
    """families.layer_types reads a config that states no layer_types as checks.config.layer_kind does (one reading
    for model, serve and shard --model and the rules); the reference is the config classes' own layer_types, made
    from the same fields (configuration_gemma3.py: every sliding_window_pattern-th layer full; configuration_qwen2.py:
    the layers from max_window_layers on sliding)."""
    from types import SimpleNamespace

    from maskcli.checks.config import layer_kind

    gemma3 = transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window_pattern=3, sliding_window=4)
    qwen2 = transformers.Qwen2Config(num_hidden_layers=6, use_sliding_window=True, sliding_window=4, max_window_layers=2)
    for own, fields in ((gemma3, {"sliding_window_pattern": 3}), (qwen2, {"use_sliding_window": True, "max_window_layers": 2})):
        stated = SimpleNamespace(num_hidden_layers=own.num_hidden_layers, sliding_window=4, **fields)  # no layer_types
        assert families.layer_types(stated) == list(own.layer_types)
        assert families.layer_types(stated) == [layer_kind(stated, i)[0] for i in range(own.num_hidden_layers)]
    # a per-layer field the rules do not read leaves the kinds unknown to them: the window then makes every layer
    assert families.layer_types(SimpleNamespace(num_hidden_layers=2, sliding_window=4, attention_layers=["global", "local"])) == \
        ["sliding_attention"] * 2


def test_right_padding_and_ids():
    config = families.tiny(families.load("llama"), name="llama")
    batch = prompt((2, 4), None, 0, "right", 128)
    assert batch.attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    given = prompt(None, np.array([[0, 5, 6], [7, 8, 9]]), 0, "left", 128)
    assert given.attention_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert given.side == "left" and prompt(None, np.array([[5, 0], [7, 8]]), 0, "left", 128).side == "right"
    assert prompt(None, np.array([[0, 5, 0]]), 0, "left", 128).side == "mixed"
    result = run("llama", config, given, new_tokens=1, attn="eager")
    assert check_against_reference(result) == 4
    with pytest.raises(MaskError, match="vocabulary is 0..127"):
        prompt(None, np.array([[1, 200]]), 0, "left", 128)


def test_the_layer_pattern_is_read_from_the_config_class_and_kept_when_shrunk():
    gemma3 = families.load("gemma3_text")
    assert families.pattern(families.layer_types(gemma3)) == "(sliding_attention x5, full_attention) x4, sliding_attention x2 (26 layers)"
    assert families.shapes(gemma3).startswith("sliding_window 4096; layer_types (sliding_attention x5, full_attention) x4")
    assert families.pattern(["a", "b", "a", "b", "a", "b", "c"]) == "(a, b) x3, c (7 layers)"
    assert families.pattern(["a", "b", "c", "b", "c", "b", "c"]) == "a, (b, c) x3 (7 layers)"
    assert families.pattern(["a"] * 4) == "a (every layer)" and families.pattern(["a", "b"]) == "a, b"
    assert families.layer_types(families.load("mistral"))[:2] == ["sliding_attention"] * 2  # a window and no layer_types
    tiny = families.tiny(families.load("gemma3_text"), name="gemma3_text")
    assert tiny.sliding_window == 4096 and tiny.hidden_size == 32 and tiny.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert families.tiny(families.load("llama4_text"), chunk_size=4).attention_chunk_size == 4


def test_a_local_config_json_and_bad_sources_are_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mistral", "sliding_window": 2, "num_hidden_layers": 7}))
    config = families.load(str(path))
    assert type(config).__name__ == "MistralConfig" and config.sliding_window == 2 and config.num_hidden_layers == 7
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    for source, message in ((str(tmp_path / "bad.json"), "no \"model_type\""), (str(tmp_path / "none.json"), "no such config file"),
                            ("lama", "unknown model family 'lama' (did you mean llama"),):
        with pytest.raises(MaskError, match=message.replace("(", r"\(")):
            families.load(source)
    with pytest.raises(MaskError, match="llama has no sliding_window"):
        families.tiny(families.load("llama"), window=3, name="llama")


@pytest.mark.parametrize("field, value, said", [
    ("sliding_window", -5, "sliding_window -5 is no size in tokens"),  # was read as no window: every layer full
    ("sliding_window", 2.5, "sliding_window 2.5 is no size in tokens"),
    ("attention_chunk_size", -1, "attention_chunk_size -1 is no size in tokens"),
    # hunt 10: 0 passed, and model ended in "cannot run --attn sdpa --cache dynamic: RuntimeError: ZeroDivisionError"
    ("sliding_window", 0, "sliding_window 0 is no size in tokens"),
    ("attention_chunk_size", 0, "attention_chunk_size 0 is no size in tokens"),
])
def test_a_config_json_with_a_negative_or_fractional_window_is_refused_in_serve_shard_and_pack(tmp_path, field, value, said):
    from typer.testing import CliRunner

    from maskcli.commands import app

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama4_text" if field == "attention_chunk_size" else "mistral", field: value}))
    for args in (["shard", "causal", "--len", "8", "--model", str(path)], ["pack", "--position-ids", "0,1,0,1", "--config", str(path)],
                 ["serve", '{"cu_seqlens_q": [0, 2], "seqused_k": [5], "causal": 1}', "--model", str(path)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and result.stdout == "", (args, result.output)
        assert result.stderr.count("\n") == 1 and said in result.stderr and "whole number of 1 or more" in result.stderr, result.stderr


def test_listing_names_families_with_what_shapes_their_masks():
    found = {family.name: family for family in families.listing()}
    assert found["mistral"].shapes.startswith("sliding_window 4096")
    assert "attention_chunk_size 8192" in found["llama4_text"].shapes
    assert found["llama"].shapes == "causal (no window, chunks or layer types)"


def test_a_family_whose_config_says_is_decoder_false_is_said_to_attend_both_ways():
    """BERT's config keeps is_decoder (False by default), and its LM head then runs without a causal mask: the listing
    says so instead of 'causal'. Checked on transformers itself: a later token changes an earlier token's output."""
    import torch

    assert families.shapes(transformers.BertConfig()).startswith("both ways: is_decoder False")
    assert families.shapes(transformers.BertConfig(is_decoder=True)) == "causal (no window, chunks or layer types)"
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.BertLMHeadModel(config).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    changed = ids.clone()
    changed[0, 3] = 9
    with torch.no_grad():
        first, second = model(ids).logits[0, 0], model(changed).logits[0, 0]
    assert not torch.allclose(first, second)  # token 0 saw token 3: both ways


@pytest.mark.parametrize("family", ["gpt_neox", "bart", "trocr"])
def test_a_family_whose_is_decoder_false_its_causal_lm_never_reads_is_said_causal(family):
    """Every config keeps is_decoder (False): GPT-NeoX's modeling code never reads it, BART's causal LM is its
    encoder-decoder's decoder, TrOCR's sets it True itself. The listing says causal, as the model attends: checked on
    transformers itself, a later token leaves an earlier token's output as it was."""
    import torch

    config = families.default_config(family)
    assert config.is_decoder is False
    assert families.shapes(config) == "causal (no window, chunks or layer types)"
    model = transformers.AutoModelForCausalLM.from_config(families.tiny(config, name=family)).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    changed = ids.clone()
    changed[0, 3] = 9
    with torch.no_grad():
        assert torch.allclose(model(ids).logits[0, :3], model(changed).logits[0, :3])


def test_chunked_prefill_put_together_is_the_one_pass_mask_and_hf_rule():
    from maskcli.hf.chunks import assembled

    config = families.tiny(families.load("gemma3_text"), window=3, name="gemma3_text")
    batch = prompt((7, 4), None, 0, "left", 128)
    result = run("gemma3_text", config, batch, new_tokens=1, prefill_chunk=3)
    assert result.steps == ["prefill 1/3", "prefill 2/3", "prefill 3/3", "decode 1"]
    assert result.chunk_holds and result.chunk_check == [
        "--prefill-chunk 3: in every layer the 3 chunks' masks put together equal the single-pass prefill mask"]
    valid = batch.attention_mask.numpy().astype(bool)
    for layer, window in ((0, 3), (5, None)):  # a sliding layer and the full one, against the double loop
        calls = sorted((c for c in result.calls if c.details["layer"] == layer and c.step < 3), key=lambda c: c.step)
        together = assembled(calls, 7)
        want = reference(valid, list(range(7)), list(range(7)), window)
        assert all((together[:, h] == want).all() for h in range(together.shape[1]))


def test_chunks_that_differ_from_one_pass_name_the_first_cell():
    from types import SimpleNamespace

    from maskcli.hf.chunks import check

    def call(keep, step, queries):
        keep = np.asarray(keep, dtype=bool)[None, None]
        return SimpleNamespace(shape=keep.shape, keep=lambda: keep, step=step,
                               details={"layer": 0, "queries": queries, "keys": [queries[1] - keep.shape[3], queries[1]]})

    causal = np.tril(np.ones((4, 4), dtype=bool))
    first = causal[:2, :2]
    second = causal[2:, :].copy()
    second[1, 0] = False  # query 3 loses key 0 in the second chunk
    lines, holds = check([call(first, 0, [0, 2]), call(second, 1, [2, 4])], [call(causal, 0, [0, 4])], ["full_attention"], 4, 2, 2)
    assert not holds and lines == ["--prefill-chunk 2: layer 0 (full_attention): the chunks put together differ from the "
                                   "single-pass prefill in 1 cells, first at batch row 0, head 0, query 3, key 0: the chunks "
                                   "mask it, one pass lets it attend"]
    lines, holds = check([call(first, 0, [0, 2]), call(causal[2:, :], 1, [2, 4])], [call(causal, 0, [0, 4])], ["full_attention"], 4, 2, 2)
    assert holds


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_static_cache_gives_every_slot_and_masks_the_ones_not_yet_filled(attn):
    config = families.tiny(families.load("llama"), name="llama")
    batch = prompt((4, 2), None, 0, "left", 128)
    result = run("llama", config, batch, new_tokens=2, attn=attn, cache="static")
    valid = np.concatenate([batch.attention_mask.numpy().astype(bool), np.ones((2, 3), dtype=bool)], axis=1)
    for call in result.calls:
        q_len, k_len = call.shape[2:]
        start = 0 if call.step == 0 else 4 + call.step - 1
        assert k_len == 4 + 2  # the static cache's slots: the prompt and the tokens fed back
        want = reference(valid, list(range(start, start + q_len)), list(range(k_len)))
        got = np.broadcast_to(call.keep(), call.shape)
        assert all((got[:, h] == want).all() for h in range(call.shape[1])), (call.step, got[:, 0].astype(int))


def test_a_layer_that_attends_twice_in_one_forward_is_one_step():
    """DiffLlama calls its attention function twice a layer per forward, once per half of the values
    (transformers/models/diffllama/modeling_diffllama.py 276 and 286): a prefill and one decode step are two steps,
    each layer's two calls at each, placed behind a static cache and its keys (no top-left decode, no cache miss)."""
    from maskcli.checks.registry import severity
    from maskcli.hf.report import view

    config = families.tiny(families.load("diffllama"), name="diffllama")
    result = run("diffllama", config, prompt((4, 2), None, 0, "left", 128), new_tokens=1, attn="sdpa", cache="static")
    assert result.steps == ["prefill", "decode 1"]
    assert sorted((call.details["layer"], call.step) for call in result.calls) == sorted(
        (layer, step) for layer in range(config.num_hidden_layers) for step in (0, 1) for _ in range(2))
    assert [call.details["queries"] for call in result.calls if call.step == 1] == [[4, 5]] * (2 * config.num_hidden_layers)
    assert result.cache_holds, result.cache_check
    assert [f.code for group in view(result).groups for f in group.findings if severity(f) == "wrong"] == []


def expected_keys(kind: str, cache: str, seen: int, new: int, window: int, slots: int) -> list[int]:
    """Where transformers 5's caches put a layer's keys (cache_utils' docstrings, written out here): a dynamic cache
    returns every key so far, its sliding layers the last window-1 before the new ones; a static cache ("sliding" is
    one too) its slots from position 0, its sliding layers (StaticSlidingWindowLayer) window slots from 0 until they
    fill, then the last window-1 before the new ones, shifted (rolled) rather than a ring."""
    if kind != "sliding_attention":
        return [0, seen + new] if cache == "dynamic" else [0, slots]
    if cache == "dynamic" or seen >= window or seen + new > window:
        return [max(seen - window + 1, 0), seen + new]
    return [0, window]


def masking_utils_reference(valid: np.ndarray, q_pos: list[int], k_pos: list[int], window: int | None) -> np.ndarray:
    """The same cells from masking_utils' own mask functions, evaluated at each absolute (q, kv) pair."""
    import torch
    from transformers import masking_utils as mu

    rule = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    rule = mu.and_masks(rule, mu.padding_mask_function(torch.from_numpy(valid)))
    return np.array([[[bool(rule(torch.tensor(b), 0, torch.tensor(q), torch.tensor(k))) for k in k_pos] for q in q_pos]
                     for b in range(valid.shape[0])])


@pytest.mark.parametrize("family, attn", [("mistral", "sdpa"), ("gemma3_text", "sdpa"), ("gpt_oss", "eager")])
@pytest.mark.parametrize("cache", ["static", "sliding", "dynamic"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_sliding_layers_behind_every_cache_are_on_absolute_positions(family, attn, cache, chunk):
    window, lengths, new = 3, (7, 4), 3
    config = families.tiny(families.load(family), window=window, name=family)
    batch = prompt(lengths, None, 0, "left", 128)
    result = run(family, config, batch, new_tokens=new, attn=attn, cache=cache, prefill_chunk=chunk)
    total = 7 + new + 1
    valid = np.concatenate([batch.attention_mask.numpy().astype(bool), np.ones((2, total), dtype=bool)], axis=1)
    types = set()
    for call in result.calls:
        kind = call.details["layer_type"]
        q0, q1 = call.details["queries"]
        # GPT-OSS's eager softmax has each head's sink logit as a last column, on no key: torch.cat([attn_weights,
        # sinks], dim=-1) (transformers/models/gpt_oss/modeling_gpt_oss.py:244, eager_attention_forward); the call
        # keeps its keys' columns alone and names the column it left out
        k_len = call.shape[3]
        assert call.details.get("sink_column") == (k_len if family == "gpt_oss" else None)
        want_keys = expected_keys(kind, cache, q0, q1 - q0, window, total - 1)
        if cache != "dynamic" and kind != "sliding_attention" and q1 - q0 > 1 and "mask_dtype" not in call.details:
            want_keys = [0, k_len]  # SDPA's is_causal path: an unpadded prefill cuts the empty slots off
        assert call.details["keys"] == want_keys, (kind, call.step, call.details)
        q_pos, k_pos = list(range(q0, q1)), list(range(*want_keys))
        want = reference(valid, q_pos, k_pos, window if kind == "sliding_attention" else None)
        assert (want == masking_utils_reference(valid, q_pos, k_pos, window if kind == "sliding_attention" else None)).all()
        got = np.broadcast_to(call.keep(), call.shape)[..., :k_len]
        assert all((got[:, h] == want).all() for h in range(call.shape[1])), (kind, call.step, got[:, 0].astype(int))
        types.add(kind)
    assert "sliding_attention" in types
    assert result.cache_holds and result.cache_first is None and len(result.calls) == len(result.types) * len(result.steps)
    assert result.cache_check == [f"cache: each step's mask is as wide as the keys its cache returned, on their positions "
                                  f"({len(result.calls)} calls)"]
    assert result.chunk_holds


def test_the_chunk_check_fails_exactly_where_chunks_change_what_the_model_computes():
    """Against an independent witness: generate's logits with and without --prefill-chunk, on a model whose later
    layer reads every position of the earlier one. (In transformers 5.24 they differ under flex with a static
    cache: the flex mask reads the static layer's query offset, its cumulative_length tensor, after the layer's
    update has added the chunk in place.)"""
    import torch

    from maskcli.hf import quiet
    from maskcli.hf.run import _flex_uncompiled, build

    config = families.tiny(families.load("llama"), name="llama")
    batch = prompt((7, 4), None, 0, "left", 128)
    for attn, cache in (("flex", "static"), ("flex", "dynamic")):
        result = run("llama", config, batch, new_tokens=1, attn=attn, cache=cache, prefill_chunk=4)
        model = build(config, attn, "llama")
        logits = []
        for chunk in ({}, {"prefill_chunk_size": 4}):
            with quiet(), torch.no_grad(), _flex_uncompiled(attn == "flex"):
                out = model.generate(batch.ids, attention_mask=batch.attention_mask, max_new_tokens=2, min_new_tokens=2,
                                     do_sample=False, pad_token_id=0, cache_implementation=cache, output_logits=True,
                                     return_dict_in_generate=True, **chunk)
            logits.append(torch.stack(out.logits))
        same = torch.allclose(logits[0], logits[1], atol=1e-5)
        assert result.chunk_holds == same, (attn, cache, result.chunk_check)
        if not same:
            assert result.chunk_check[0].startswith("--prefill-chunk 4: layer 0 (full_attention): the chunks put together "
                                                    "differ from the single-pass prefill")
            assert "query 0, key 1: the chunks let it attend, one pass masks it" in result.chunk_check[0]


def test_the_cache_check_names_the_first_cell_where_a_mask_and_its_keys_disagree():
    from types import SimpleNamespace

    from maskcli.hf.cache import Update
    from maskcli.hf.widths import check, order_notes

    def call(keep, step, queries, index=0):
        keep = np.asarray(keep, dtype=bool)[None, None]
        return SimpleNamespace(shape=keep.shape, keep=lambda: keep, step=step, index=index, stored={"form": "bits"},
                               details={"layer": 0, "layer_type": "sliding_attention", "queries": queries})

    window = np.array([[0, 1, 1]])  # query 5 sees keys 4-5 of columns 3-5
    ok = Update(0, 1, 5, 1, np.array([3, 4, 5]), (3, 3), True)
    assert check([call(window, 1, [5, 6])], [ok], ["prefill", "decode 1"])[1]
    shifted = Update(0, 1, 5, 1, np.array([3, 4, 5]), (3, 2), True)  # the mask thinks its keys start at 2
    lines, holds, first = check([call(window, 1, [5, 6])], [shifted], ["prefill", "decode 1"])
    assert not holds and first == {"layer": 0, "layer_type": "sliding_attention", "step": "decode 1", "query": 5, "key": 0,
                                   "call": 0, "why": first["why"]}
    assert lines[0] == ("cache: layer 0 (sliding_attention) at decode 1: the mask's key column 0 is position 2 (kv_offset 2), "
                        "the cache's slot 0 holds position 3; first cell: query 5, key column 0")
    narrow = Update(0, 1, 5, 1, np.array([3, 4]), (3, 3), True)
    lines, holds, first = check([call(window, 1, [5, 6])], [narrow], ["prefill", "decode 1"])
    assert (first["query"], first["key"]) == (5, 2) and "the mask has 3 key columns, the cache returned 2 keys" in lines[0]
    empty = Update(0, 0, 0, 2, np.array([0, 1, -1]), (3, 0), False)  # a static slot not yet written, attended
    lines, holds, first = check([call([[1, 0, 0], [1, 1, 1]], 0, [0, 2])], [empty], ["prefill"])
    assert (first["query"], first["key"]) == (1, 2) and "holds no key yet" in lines[0]
    ring = Update(0, 1, 5, 1, np.array([6, 4, 5]), (4, 3), True)
    assert order_notes([call(window, 1, [6, 7])], [ring], ["prefill", "decode 1"]) == [
        "cache: layer 0 (sliding_attention) at decode 1: its slots are not in position order (slot 0: 6, slot 1: 4, slot 2: 5)"]


def test_slot_positions_are_read_off_the_keys_in_order_static_or_a_ring():
    import torch

    from maskcli.hf.cache import slot_positions

    kept = torch.randn(2, 2, 9, 4)
    assert slot_positions(kept[:, :, 5:], kept).tolist() == [5, 6, 7, 8]  # the last keys (dynamic, shifted)
    static = torch.cat([kept[:, :, :9], torch.zeros(2, 2, 3, 4)], dim=2)
    assert slot_positions(static, kept).tolist() == list(range(9)) + [-1] * 3  # slots from 0, three not written
    ring = kept[:, :, [7, 8, 4, 5, 6]]
    assert slot_positions(ring, kept).tolist() == [7, 8, 4, 5, 6]


def test_a_mask_built_on_the_wrong_positions_fails_the_cache_check(monkeypatch):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    original = DynamicSlidingWindowLayer.get_mask_sizes

    def off_by_one(self, query_length):  # a runtime bug: the mask's keys start one position late once the window fills
        length, offset = original(self, query_length)
        return length, offset + 1 if offset else offset

    monkeypatch.setattr(DynamicSlidingWindowLayer, "get_mask_sizes", off_by_one)
    config = families.tiny(families.load("mistral"), window=3, name="mistral")
    result = run("mistral", config, prompt((5, 3), None, 0, "left", 128), new_tokens=2, attn="eager")
    assert not result.cache_holds
    assert result.cache_first == {"layer": 0, "layer_type": "sliding_attention", "step": "decode 1", "query": 5, "key": 0,
                                  "call": result.cache_first["call"],
                                  "why": "the mask's key column 0 is position 4 (kv_offset 4), the cache's slot 0 holds position 3"}


def test_tryout_says_whether_a_family_runs_tiny_or_why_not():
    from maskcli.hf.run import tryout

    assert tryout("llama") == "runs" and tryout("gemma2") == "runs (eager only)"
    assert tryout("prophetnet").startswith("cannot be made tiny: setting num_hidden_layers fails (NotImplementedError")


@pytest.mark.parametrize("family,window", [("gemma4_text", 3), ("gemma3n_text", 3), ("deepseek_v2", None),
                                           ("recurrent_gemma", 3), ("falcon_h1", None)])
def test_per_layer_shared_and_derived_configs_are_made_tiny(family, window, monkeypatch):
    """Gemma 4 keeps its full layers' head_dim per layer (transformers' per_layer_config, whose global value refuses to
    be read); Gemma 3n an intermediate size per layer and its last layers reusing earlier layers' keys; DeepSeek-V2's
    defaults leave its router's top-k None; RecurrentGemma and Falcon-H1 work their layer_types out from other fields
    (attribute_map to a property), RecurrentGemma with a recurrent width of its own. Each runs tiny, every call is the
    kernel's own (an independent SDPA capture) and the double loop's rule on absolute positions."""
    from maskcli.hf.run import build

    config = families.tiny(families.load(family), window=window, name=family)
    assert sum(p.numel() for p in build(config, "sdpa", family).parameters()) < families.MOST_PARAMETERS
    if family == "gemma3n_text":
        assert config.num_kv_shared_layers == config.num_hidden_layers // 2 == 5 and config.intermediate_size == [64] * 10
    batch = prompt((5, 3), None, 0, "left", 128)
    seen = kernel_calls(build(config, "sdpa", family), batch, 2, False, monkeypatch)
    result = run(family, config, batch, new_tokens=2)
    assert [call.shape for call in result.calls] == [shape for shape, _ in seen]
    assert all((np.broadcast_to(call.keep(), call.shape) == keep).all() for call, (_, keep) in zip(result.calls, seen))
    assert check_against_reference(result, window=window) == len(result.calls) > 0
    assert result.cache_holds
    if family == "gemma3n_text":  # (layers 5-9 read layers 3's and 4's caches: none of their own to compare)
        assert "cache: layers 5-9 reuse earlier layers' keys (num_kv_shared_layers 5) and write no cache of their own: " \
               "not compared" in result.cache_check


def test_compressed_key_layers_are_refused_saying_why():
    """DeepSeek-V4's compressed layers append one key per block of tokens to the softmax: read as positions they were
    later keys (causal-flag-ignored and sees-later on a correct model), so the family is refused, its layer types named."""
    from maskcli.errors import MaskError

    config = families.load("deepseek_v4")
    assert {"compressed_sparse_attention", "heavily_compressed_attention"} <= set(config.layer_types)
    with pytest.raises(MaskError, match=r"^deepseek_v4: its compressed_sparse_attention and heavily_compressed_attention "
                       r"layers attend to compressed keys, one per block of tokens"):
        families.tiny(config, name="deepseek_v4")


@pytest.mark.parametrize("family", ["bart", "whisper", "falcon", "deepseek_v3", "gptj"])
def test_encoder_decoder_latent_and_rotary_sizes_and_derived_head_dims_are_made_tiny(family, monkeypatch):
    """BART's and Whisper's encoder and decoder keep their own heads, FFN widths and layer counts (num_hidden_layers
    and num_attention_heads name the encoder's: the decoder stayed full size, and 6 heads did not divide 32); Falcon's
    head_dim is a property worked out from the others; DeepSeek's latent attention and GPT-J's rotary part have widths
    of their own (64 rotary dims over heads of 16). Each runs tiny, and every call is the kernel's own (an
    independent SDPA capture, its query heads left on the head axis: transformers 5.25 packs tiny Falcon's
    multi-query decode into the query axis, which maskcli reads back as heads x 1 query) and HF's rule."""
    from maskcli.hf.run import build, tryout

    config = families.tiny(families.load(family), name=family)
    for key in families.ENCODER_DECODER_SIZES:
        if hasattr(config, key):
            assert getattr(config, key) == (2 if key.endswith(("_heads", "_layers")) else families.SIZES["intermediate_size"])
    for key, value in families.LATENT.items():
        assert getattr(config, key, None) in (None, value)
    assert tryout(family) == "runs"
    batch = prompt((5, 3), None, 0, "left", 128)
    seen = kernel_calls(build(config, "sdpa", family), batch, 2, True, monkeypatch)
    result = run(family, config, batch, new_tokens=2)
    assert [call.shape for call in result.calls] == [shape for shape, _ in seen]
    assert all((np.broadcast_to(call.keep(), call.shape) == keep).all() for call, (_, keep) in zip(result.calls, seen))
    assert check_against_reference(result) == len(result.calls) == 6


def kernel_calls(model, batch, new_tokens: int, force_gqa: bool, monkeypatch) -> list[tuple[tuple, np.ndarray]]:
    """An independent capture: torch's SDPA swapped for a recorder while generate runs, each call's (query shape,
    key length) and the mask the kernel got, broadcast over its heads and queries (True = may attend)."""
    import torch

    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        shape = (*query.shape[:3], key.shape[2])
        keep = np.ones(shape, dtype=bool) if attn_mask is None else np.broadcast_to(
            (attn_mask if attn_mask.dtype == torch.bool else attn_mask > torch.finfo(attn_mask.dtype).min / 2).numpy(), shape)
        seen.append((shape, keep))
        return real(query, key, value, attn_mask=attn_mask, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        if force_gqa:  # transformers' own switch: enable_gqa, the query heads left on the head axis
            patch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
        with torch.no_grad():
            model.generate(batch.ids, attention_mask=batch.attention_mask, max_new_tokens=new_tokens + 1,
                           min_new_tokens=new_tokens + 1, do_sample=False, pad_token_id=batch.pad_id)
    return seen


def test_a_gqa_decode_whose_heads_sdpa_packs_into_the_query_axis_is_one_query_per_head(monkeypatch):
    """transformers' SDPA path packs a one-query GQA call's heads into the query axis ((B, 4, 1, D) -> (B, 2, 2, D),
    pack_gqa): the kernel gets 2 'queries'. maskcli reads the call as the model means it, 4 heads x 1 query at the
    step's position, the same as the kernel gets where transformers is told to leave the heads (enable_gqa)."""
    from maskcli.hf.run import build

    config = families.tiny(families.load("llama"), name="llama")
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 8  # 2 query heads a key head
    batch = prompt((5, 3), None, 0, "left", 128)
    packed = kernel_calls(build(config, "sdpa", "llama"), batch, 2, False, monkeypatch)
    assert [shape for shape, _ in packed[2:]] == [(2, 2, 2, 6)] * 2 + [(2, 2, 2, 7)] * 2  # what the kernel got
    unpacked = kernel_calls(build(config, "sdpa", "llama"), batch, 2, True, monkeypatch)
    result = run("llama", config, batch, new_tokens=2)
    assert len(result.calls) == len(unpacked) == 6
    for call, (shape, keep) in zip(result.calls, unpacked):
        assert call.shape == shape and (np.broadcast_to(call.keep(), shape) == keep).all(), (call.step, call.shape, shape)
        assert call.details["queries"] == ([0, 5] if call.step == 0 else [4 + call.step, 5 + call.step])
    assert [call.details.get("packed_heads") for call in result.calls] == [None, None, 2, 2, 2, 2]


def test_laguna_keeps_its_heads_per_layer_and_is_made_tiny_in_each(monkeypatch):
    """Laguna's heads are per layer (num_attention_heads_per_layer, 48 each by default): each tiny layer gets the tiny
    count, so no decode is packed, and every call is the kernel's own (an independent SDPA capture) and HF's rule."""
    from maskcli.hf.run import build

    config = families.tiny(families.load("laguna"), name="laguna")
    assert config.num_attention_heads_per_layer == [2, 2] and config.num_key_value_heads == 2
    batch = prompt((5, 3), None, 0, "left", 128)
    seen = kernel_calls(build(config, "sdpa", "laguna"), batch, 2, False, monkeypatch)
    result = run("laguna", config, batch, new_tokens=2)
    assert [call.shape for call in result.calls] == [shape for shape, _ in seen] == \
        [(2, 2, 5, 5)] * 2 + [(2, 2, 1, 6)] * 2 + [(2, 2, 1, 7)] * 2
    assert all((np.broadcast_to(call.keep(), call.shape) == keep).all() for call, (_, keep) in zip(result.calls, seen))
    assert check_against_reference(result) == 6


def test_laguna_chunked_prefill_with_a_window_holds():
    config = families.tiny(families.load("laguna"), window=3, name="laguna")
    result = run("laguna", config, prompt((7, 4), None, 0, "left", 128), new_tokens=2, prefill_chunk=3)
    assert result.chunk_holds and result.cache_holds, (result.chunk_check, result.cache_check)


def test_chunked_prefill_of_a_layer_that_attends_twice_compares_each_of_its_calls():
    """DiffLlama attends twice a layer per forward: each chunk has 2 calls of a layer and one pass 2; the k-th calls of
    the chunks put together are the k-th of one pass, and each the double loop's rule on absolute positions."""
    from maskcli.hf.chunks import assembled

    config = families.tiny(families.load("diffllama"), name="diffllama")
    batch = prompt((5, 3), None, 0, "left", 128)
    result = run("diffllama", config, batch, new_tokens=1, prefill_chunk=2)
    assert result.chunk_holds and result.chunk_check == [
        "--prefill-chunk 2: in every layer the 3 chunks' masks put together equal the single-pass prefill mask"]
    valid = batch.attention_mask.numpy().astype(bool)
    want = reference(valid, list(range(5)), list(range(5)))
    for layer in range(config.num_hidden_layers):
        calls = [c for c in result.calls if c.details["layer"] == layer and c.step < 3]
        assert len(calls) == 6
        for nth in (0, 1):
            together = assembled([calls[2 * step + nth] for step in range(3)], 5)
            assert all((together[:, h] == want).all() for h in range(together.shape[1]))


@pytest.mark.parametrize("family, silent", [("lfm3", "layers 0-1, 3 (conv) make"),
                                            ("lara_mini", "layers 0, 2 (linear_attention) make")])
def test_chunked_prefill_with_layers_that_make_no_attention_call_holds(family, silent):
    """A convolution or linear attention layer makes no attention call, chunked or not: nothing to compare, no failure."""
    config = families.tiny(families.load(family), name=family)
    batch = prompt((5, 3), None, 0, "left", 128)
    result = run(family, config, batch, new_tokens=1, prefill_chunk=2)
    assert result.chunk_holds and result.chunk_check == [
        "--prefill-chunk 2: in every layer that attends the 3 chunks' masks put together equal the single-pass prefill mask",
        f"--prefill-chunk 2: {silent} no attention call: no mask to compare"]
    assert check_against_reference_chunked(result, batch, 2) > 0


def check_against_reference_chunked(result, batch, size: int) -> int:
    """Each attending layer's prefill chunks put together against the double loop's causal rule with the padding."""
    from maskcli.hf.chunks import assembled

    valid = batch.attention_mask.numpy().astype(bool)
    prompt_len = valid.shape[1]
    chunks = -(-prompt_len // size)
    want = reference(valid, list(range(prompt_len)), list(range(prompt_len)))
    layers = sorted({c.details["layer"] for c in result.calls})
    for layer in layers:
        calls = sorted((c for c in result.calls if c.details["layer"] == layer and c.step < chunks), key=lambda c: c.step)
        together = assembled(calls, prompt_len)
        assert all((together[:, h] == want).all() for h in range(together.shape[1])), layer
    return len(layers)


def test_a_second_call_of_a_layer_that_differs_is_named_by_its_place_in_the_forward():
    from types import SimpleNamespace

    from maskcli.hf.chunks import check

    def call(keep, step, queries):
        keep = np.asarray(keep, dtype=bool)[None, None]
        return SimpleNamespace(shape=keep.shape, keep=lambda: keep, step=step,
                               details={"layer": 0, "queries": queries, "keys": [queries[1] - keep.shape[3], queries[1]]})

    causal = np.tril(np.ones((4, 4), dtype=bool))
    wrong = causal[2:, :].copy()
    wrong[0, 1] = False  # query 2 loses key 1 in the second call of the second chunk
    chunked = [call(causal[:2, :2], 0, [0, 2]), call(causal[:2, :2], 0, [0, 2]), call(causal[2:], 1, [2, 4]), call(wrong, 1, [2, 4])]
    lines, holds = check(chunked, [call(causal, 0, [0, 4])] * 2, ["full_attention"], 4, 2, 2)
    assert not holds and lines == ["--prefill-chunk 2: layer 0 (full_attention), its call 2 of 2 in a forward: the chunks put "
                                   "together differ from the single-pass prefill in 1 cells, first at batch row 0, head 0, "
                                   "query 2, key 1: the chunks mask it, one pass lets it attend"]
    lines, holds = check(chunked[:3], [call(causal, 0, [0, 4])] * 2, ["full_attention"], 4, 2, 2)
    assert not holds and lines == ["--prefill-chunk 2: layer 0 (full_attention) made 2/1 calls at its 2 chunks and 2 in one "
                                   "pass: not compared"]


def test_a_hundred_thousand_layers_are_counted_per_type_at_once_not_grouped_for_hours():
    import random
    import time

    rng = random.Random(0)
    types = [rng.choice(["full_attention", "sliding_attention"]) for _ in range(100_000)]
    runs = 1 + sum(a != b for a, b in zip(types, types[1:]))  # counted here independently of pattern()
    start = time.process_time()
    said = families.pattern(types)
    assert time.process_time() - start < 20  # a hang guard: under a second here (4,000 layers took 2.4 s, growing as n^3)
    first = types[0]
    other = "sliding_attention" if first == "full_attention" else "full_attention"
    assert said == (f"{first} x{types.count(first):,}, {other} x{types.count(other):,} (100,000 layers in {runs:,} runs)")
    assert families.pattern(["a", "b"] * 30_000 + ["c"]) == "(a, b) x30000, c (60001 layers)"  # a long pattern stays one


def test_a_config_whose_last_new_layer_type_comes_late_is_refused_before_a_layer_is_built():
    from types import SimpleNamespace

    late = SimpleNamespace(layer_types=["sliding_attention"] * 99_999 + ["full_attention"], num_hidden_layers=100_000)
    with pytest.raises(MaskError) as refused:
        families.tiny(late, name="late.json (gemma3_text)")
    assert str(refused.value) == (
        "late.json (gemma3_text): its first full_attention layer is layer 99,999, so a tiny model with one layer of each "
        "type would have 100,000 layers, past the 256 maskcli builds (about 3,000,000 parameters): give a config.json "
        "whose layer_types has each type within its first 256 layers (num_hidden_layers to match)")
    assert late.num_hidden_layers == 100_000  # refused before anything was set


@pytest.mark.parametrize("count", [-1, 0, 2.5, "2"])
def test_a_config_with_no_layers_is_refused_not_made_tiny_with_two(count):
    from types import SimpleNamespace

    with pytest.raises(MaskError) as refused:  # tiny() made any count 2 layers, and the run showed their masks
        families.tiny(SimpleNamespace(num_hidden_layers=count), name="bad.json (llama)")
    assert str(refused.value) == f"bad.json (llama): num_hidden_layers {count!r}: a model has a whole number of layers, 1 or more"


def test_kv_shared_layers_that_attend_only_the_prefills_last_query_place_it_last(monkeypatch):
    """Gemma 4's KV-shared layers slice the prefill to generate's logits_to_keep (its last token) before they attend:
    their (B, H, 1, Lk) prefill calls are the last prompt position's query (it read as position 0, and a window of
    1024 then 'held 1 real token': window-miscounted on a correct model). Against the double loop and the kernel's own."""
    from maskcli.hf.run import build

    config = families.tiny(families.load("gemma4_unified_assistant"), name="gemma4_unified_assistant")
    assert config.num_kv_shared_layers > 0
    batch = prompt((5, 3), None, 0, "left", 128)
    seen = kernel_calls(build(config, "sdpa", "gemma4_unified_assistant"), batch, 2, False, monkeypatch)
    result = run("gemma4_unified_assistant", config, batch, new_tokens=2)
    sliced = [call for call in result.calls if call.step == 0 and call.shape[2] == 1]
    assert sliced and all(call.details["queries"] == [4, 5] and call.details["keys"] == [0, 5] for call in sliced)
    valid = batch.attention_mask.numpy().astype(bool)
    for call in sliced:
        assert (np.broadcast_to(call.keep(), call.shape)[:, 0] == reference(valid, [4], list(range(5)))).all()
    assert all((np.broadcast_to(call.keep(), call.shape) == keep).all() for call, (_, keep) in zip(result.calls, seen))


@pytest.mark.parametrize("refuses", [("sdpa",), ("sdpa", "eager")])
def test_try_attn_eager_is_said_only_where_the_family_builds_with_eager(refuses, monkeypatch):
    """A family's own code refusing its config: the hint names --attn eager only where eager builds (DBRX's attention
    config lacks rope_theta under every attention: no other --attn helps)."""
    import transformers

    from maskcli.hf.run import build

    made = transformers.AutoModelForCausalLM.from_config

    def from_config(config, attn_implementation=None, **kwargs):
        if attn_implementation in refuses:
            raise AttributeError("'LlamaAttentionConfig' object has no attribute 'rope_theta'")
        return made(config, attn_implementation=attn_implementation, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", from_config)
    with pytest.raises(MaskError) as raised:
        build(families.tiny(families.default_config("llama")), "sdpa", "llama")
    said = str(raised.value)
    assert said.startswith("llama cannot be built tiny with --attn sdpa: AttributeError: 'LlamaAttentionConfig' object "
                           "has no attribute 'rope_theta'")
    assert said.endswith("; try --attn eager") == (refuses == ("sdpa",))
