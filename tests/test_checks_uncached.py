"""checks/uncached.py: a decode step placed past every key it is handed, fewer than its site's first pass attended."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

UNCACHED = Path(__file__).parent / "data" / "uncached"


def test_megatron_flash_decode_with_query_cu_seqlens_is_flagged(tmp_path):
    """bigcode-project/Megatron-LM f1a50a3 (NVIDIA Megatron-LM "Flash Attention inference fix"; written blind, batch
    blind-eg): FlashSelfAttention built the key cu_seqlens from the query length and kept causal=True at decode, so
    each one-token step attended one key row (a CPU stand-in runs SDPA per cu_seqlens segment). The model call's
    position_ids put the first decode query at 6, after a 6-token prompt; the fix hands the whole prefix."""
    [hit, *_] = check_bug(tmp_path, "bigcode_megatron_flash_self_attention_decode_uses_query_cu_seqlens_and_causal",
                          "decode-keys-missing")
    prompt = 6  # the prompt's length: the first decode token's position
    assert f"position {prompt} " in hit["message"] and f"({prompt} keys)" in hit["message"], hit


def test_a_static_cache_written_but_not_attended_is_flagged(tmp_path):
    # written another way: a static cache indexed by cache_position, eager matmul + softmax, grouped heads, a batch of
    # two; the step's own keys handed to the kernel instead of the cache just written
    [hit, *_] = check_bug(tmp_path, "static_cache_decode_attends_new_keys_only", "decode-keys-missing", UNCACHED)
    assert "position 5 " in hit["message"] and "(5 keys)" in hit["message"], hit


def test_tokens_alone_and_a_windowed_cache_read_are_quiet(tmp_path):
    # a layer whose tokens attend only themselves, stepped one token on at position 4, then decode steps
    # that read a cache cut to a window: neither is a step handed none of its keys
    status, found, report = traced(tmp_path, "alone_tokens_step_and_windowed_decode", False, UNCACHED)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_suffix_rescored_without_a_cache_at_its_true_positions_is_quiet(tmp_path):
    """quiet-zk, written another way (Mistral's receptive-field check in quiet_blind is the first): Qwen2 with
    sliding_window=3 on 3 layers, a batch scored whole, then each row's last 7 tokens again with use_cache=False and
    their true position_ids, sdpa and eager. The model call states it keeps no cache, so its keys are its own tokens,
    none missing (the old rule said decode-keys-missing at position 8)."""
    import pytest

    pytest.importorskip("transformers")
    quiet = Path(__file__).parent / "data" / "quiet"
    status, found, report = traced(tmp_path, "qwen2_sliding_suffix_rescored_without_cache", False, quiet)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_ktransformers_prefix_cache_prefill_attends_its_new_chunk_alone(tmp_path):
    """kvcache-ai/ktransformers 2ffb43f9 (written blind, batch blind-mo; caught before any rule changed for it): the
    server reused a conversation's cached prefix and prefilled only the new tokens, and the MLA layer stored their keys
    in the paged cache but attended over the new tokens alone. The fix reads the prefix and the new keys back."""
    from checkbugs import check_bug

    hit = check_bug(tmp_path, "ktransformers_mla_prefix_cache_prefill_attends_only_new_chunk", "decode-keys-missing")[0]
    assert "query 0 sits at position 12" in " ".join(hit["message"].split())


def test_aprender_self_speculative_verify_resets_the_kv_length(tmp_path):
    """paiml/aprender#2014 (written blind, batch blind-ml; missed before: its positions are a Python int and its prompt
    is fed token by token, no first pass of several): the verify step reset every layer's GPU KV length to 0 while RoPE
    positions counted on, so query 7 attended itself alone. An earlier step behind the cache that sees keys before its
    own now shows the layer attends back, and an int `position` in the attention's frames places the queries."""
    hit = check_bug(tmp_path, "aprender_self_speculative_verify_resets_gpu_kv_len", "decode-keys-missing")[0]
    message = " ".join(hit["message"].split())
    assert "query 0 sits at position 7 (`position` in OwnedQuantizedModelCuda.forward_gpu_resident())" in message


def test_a_chat_turns_cache_cleared_while_start_pos_carries_on(tmp_path):
    """Written another way (tests/data/uncached): Meta-llama-style `forward(tokens, start_pos)` fed token by token, a
    new empty cache made for the second turn while start_pos carries on; its first token, at position 6, attends
    itself alone. The fix keeps the cache and matches one pass over the conversation."""
    hit = check_bug(tmp_path, "chat_turns_cache_cleared_start_pos_carried", "decode-keys-missing", UNCACHED)[0]
    assert "query 0 sits at position 6 (`start_pos` in forward())" in " ".join(hit["message"].split())
