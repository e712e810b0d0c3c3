# Correct program (quiet batch quiet-r134a).
# Citation: huggingface/transformers v5.25.0 (installed release):
#   src/transformers/generation/utils.py (GenerationMixin._prefill: with `generation_config.prefill_chunk_size` the
#   prompt is split by `torch.split(prefill_ids, chunk_size, dim=-1)` and each chunk is run through the cache with
#   `attention_mask[:, :current_length]`; prepare_inputs_for_generation gives position_ids from
#   attention_mask.cumsum(-1) - 1), src/transformers/models/mistral/modeling_mistral.py (MistralModel.forward:
#   create_causal_mask / create_sliding_window_causal_mask by `config.sliding_window`), src/transformers/cache_utils.py
#   (DynamicCache(config=...) keeps the last sliding_window - 1 keys per layer), src/transformers/masking_utils.py
#   (sliding_window_overlay: a key is seen when q_idx - kv_idx < sliding_window).
# A tiny Mistral with a sliding window of 4 generates greedily from a left-padded batch whose prompts are longer than
# the window, with the prompt prefilled in chunks of 3 (a chunk that straddles the cache's trimmed window), as the
# transformers docs suggest for long prompts. The output is checked against a hand-written Mistral forward (a loop over
# queries, each listing the keys it sees, window and causality written out) run on each prompt alone, unpadded, recomputing
# the whole sequence at each step, and against generate without chunking.
import torch
from transformers import MistralConfig, MistralForCausalLM

PAD_ID = 0
SLIDING_WINDOW = 4
PREFILL_CHUNK_SIZE = 3
MAX_NEW_TOKENS = 8


def build_model():
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=SLIDING_WINDOW,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    # Larger attention weights than the default init so that which keys are seen decides the greedy tokens.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


def left_pad(prompts):
    length = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), length), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, length - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, length - len(prompt):] = 1
    return input_ids, attention_mask


# ---- reference: Mistral written out by hand, one unpadded sequence, whole sequence every step ----

def rms_norm(x, norm):
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def rope(x, positions, inv_freq):
    # x: (seq, heads, head_dim); the rotate_half layout of the HF Llama / Mistral code.
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def reference_logits(model, tokens, window):
    config = model.config
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // n_heads
    inv_freq = model.model.rotary_emb.inv_freq
    seq = len(tokens)
    positions = torch.arange(seq)
    h = model.model.embed_tokens.weight[torch.tensor(tokens)]
    for layer in model.model.layers:
        attn = layer.self_attn
        x = rms_norm(h, layer.input_layernorm)
        q = rope((x @ attn.q_proj.weight.T).view(seq, n_heads, head_dim), positions, inv_freq)
        k = rope((x @ attn.k_proj.weight.T).view(seq, n_kv, head_dim), positions, inv_freq)
        v = (x @ attn.v_proj.weight.T).view(seq, n_kv, head_dim)
        k = k.repeat_interleave(n_heads // n_kv, dim=1)
        v = v.repeat_interleave(n_heads // n_kv, dim=1)
        out = torch.zeros(seq, n_heads, head_dim)
        for i in range(seq):
            seen = [j for j in range(seq) if j <= i and (window is None or i - j < window)]
            scores = torch.einsum("hd,khd->hk", q[i], k[seen]) * head_dim**-0.5
            out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[seen])
        h = h + out.reshape(seq, -1) @ attn.o_proj.weight.T
        x = rms_norm(h, layer.post_attention_layernorm)
        mlp = layer.mlp
        h = h + (torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return rms_norm(h, model.model.norm) @ model.lm_head.weight.T


def reference_generate(model, prompt, max_new_tokens, window):
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(reference_logits(model, tokens, window)[-1].argmax()))
    return tokens[len(prompt):]


def main():
    model = build_model()
    prompts = [
        [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41],
        [1, 40, 41, 42, 43, 44, 45],
        [1, 7, 3, 60, 22],
    ]
    input_ids, attention_mask = left_pad(prompts)
    prompt_length = input_ids.shape[1]

    with torch.no_grad():
        chunked = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            prefill_chunk_size=PREFILL_CHUNK_SIZE,
            eos_token_id=None,
            return_dict_in_generate=True,
            output_scores=True,
        )
        whole = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
        )
        expected = [reference_generate(model, p, MAX_NEW_TOKENS, SLIDING_WINDOW) for p in prompts]
        unwindowed = [reference_generate(model, p, MAX_NEW_TOKENS, None) for p in prompts]

        # The first scores are the logits after the last prompt chunk: compare them with the reference's.
        for row, prompt in enumerate(prompts):
            ref_last = reference_logits(model, prompt, SLIDING_WINDOW)[-1]
            err = (chunked.scores[0][row] - ref_last).abs().max().item()
            assert err < 1e-4, (row, err)

    got = chunked.sequences[:, prompt_length:].tolist()
    for row, prompt in enumerate(prompts):
        print(f"prompt {row} ({len(prompt)} tokens): chunked {got[row]} reference {expected[row]}")
    assert got == expected, (got, expected)
    assert whole[:, prompt_length:].tolist() == expected
    # The window decides the tokens here, so a reference without it must disagree somewhere.
    assert unwindowed != expected
    print("chunked prefill with the sliding window matches the per-sequence reference")


if __name__ == "__main__":
    main()
