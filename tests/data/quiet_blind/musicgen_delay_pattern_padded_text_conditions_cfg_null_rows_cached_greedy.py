"""MusicGen as huggingface/transformers writes it: models/musicgen/modeling_musicgen.py,
MusicgenForCausalLM.build_delay_pattern_mask / apply_delay_pattern_mask (codebook k delayed by k
frames, BOS/PAD in the lower triangle, PAD in the upper), MusicgenForConditionalGeneration.forward
(`encoder_hidden_states = encoder_hidden_states * attention_mask[..., None]`, encoder_attention_mask =
the T5 padding mask), and _prepare_text_encoder_kwargs_for_generation: for classifier-free guidance
the batch is doubled with `torch.zeros_like(last_hidden_state)` and `torch.zeros_like(attention_mask)`,
so every "null" row's cross-attention has NO visible condition token, by design; its values are all
zero, so whatever weights the softmax gives, the cross-attention output is exactly 0 (bias=False).
The decoder is built from MusicgenDecoderConfig (tiny), eager attention, float64; the T5 encoder
outputs are random stand-ins (the decoder only sees hidden states and their mask).

Checks: (1) teacher-forced logits over the delayed codes, batch of 3 prompts padded to 6 text tokens
(lengths 6/3/1), equal each prompt alone with its unpadded text and no mask; (2) a null (CFG) row
equals the same decoder given ONE zero condition token left visible; (3) cached greedy generation
with CFG (guidance 3.0) and apply_delay_pattern_mask equals recomputation without a cache each step.
"""
import torch
from transformers import MusicgenDecoderConfig, MusicgenForCausalLM

torch.manual_seed(0)
K, VOC, S = 4, 24, 6
cfg = MusicgenDecoderConfig(vocab_size=VOC, num_codebooks=K, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
                            pad_token_id=VOC, bos_token_id=VOC, dropout=0.0)
cfg._attn_implementation = "eager"
model = MusicgenForCausalLM(cfg).double().eval()
BOS = PAD = VOC

lens = [6, 3, 1]
B = len(lens)
t5_out = torch.randn(B, S, 32, dtype=torch.float64)
attention_mask = torch.zeros(B, S, dtype=torch.long)
for b, n in enumerate(lens):
    attention_mask[b, :n] = 1
enc = t5_out * attention_mask[..., None]            # as MusicgenForConditionalGeneration.forward

n_frames = 7
codes = torch.randint(0, VOC, (B, K, n_frames))
prompt = torch.cat([torch.full((B, K, 1), BOS), codes], -1).reshape(B * K, -1)
_, delayed = model.build_delay_pattern_mask(prompt, pad_token_id=PAD, max_length=n_frames + K)
assert (delayed != -1).all()
delayed = delayed.reshape(B, K, -1)
for k in range(K):                                   # codebook k is codes[k] shifted right by k+1
    assert (delayed[:, k, k + 1:k + 1 + n_frames] == codes[:, k]).all()


def logits_of(ids, states, mask, **kw):
    Bn = ids.shape[0]
    return model(input_ids=ids.reshape(Bn * K, -1), encoder_hidden_states=states,
                 encoder_attention_mask=mask, **kw).logits.reshape(Bn, K, ids.shape[-1], -1)


with torch.no_grad():
    batch = logits_of(delayed, enc, attention_mask)
    d1 = max((logits_of(delayed[b:b + 1], t5_out[b:b + 1, :n], None)[0] - batch[b]).abs().max().item()
             for b, n in enumerate(lens))
    # (2) CFG null rows: zero states, zero mask
    null = logits_of(delayed, torch.zeros_like(enc), torch.zeros_like(attention_mask))
    one_zero = logits_of(delayed, torch.zeros(B, 1, 32, dtype=torch.float64), torch.ones(B, 1, dtype=torch.long))
    d2 = (null - one_zero).abs().max().item()
    assert torch.isfinite(null).all()

    # (3) greedy generation with CFG and the delay pattern, cached vs uncached
    gs, max_length = 3.0, 9
    start = torch.full((B * K, 1), BOS)
    ids, pattern = model.build_delay_pattern_mask(start, pad_token_id=PAD, max_length=max_length)
    cfg_states = torch.cat([enc, torch.zeros_like(enc)], 0)
    cfg_mask = torch.cat([attention_mask, torch.zeros_like(attention_mask)], 0)

    def step_logits(lg):                              # lg (2B, K, T, V) -> (B*K, V)
        lg = lg.reshape(2 * B, K, lg.shape[-2], lg.shape[-1])
        cond, uncond = lg[:B, :, -1], lg[B:, :, -1]
        return (uncond + gs * (cond - uncond)).reshape(B * K, -1)

    seq_c, seq_r, cache, d3 = ids.clone(), ids.clone(), None, 0.0
    while seq_c.shape[-1] < max_length:
        inp = seq_c if cache is None else seq_c[:, -1:]
        inp2 = torch.cat([inp.reshape(B, K, -1)] * 2, 0)
        out = model(input_ids=inp2.reshape(2 * B * K, -1), encoder_hidden_states=cfg_states,
                    encoder_attention_mask=cfg_mask, cache=cache, use_cache=True)
        cache = out.cache
        lc = step_logits(out.logits)
        ref_in = torch.cat([seq_r.reshape(B, K, -1)] * 2, 0)
        lr = step_logits(logits_of(ref_in, cfg_states, cfg_mask))
        d3 = max(d3, (lc - lr).abs().max().item())
        nxt_c = model.apply_delay_pattern_mask(torch.cat([seq_c, lc.argmax(-1, keepdim=True)], -1), pattern)
        nxt_r = model.apply_delay_pattern_mask(torch.cat([seq_r, lr.argmax(-1, keepdim=True)], -1), pattern)
        seq_c, seq_r = nxt_c, nxt_r
    gen = seq_c.reshape(B, K, -1)
    for k in range(K):                                # delay positions kept as BOS/PAD
        assert (gen[:, k, :k + 1] == BOS).all()

print(f"padded text conditions vs each prompt alone: max diff = {d1:.3e}")
print(f"CFG null rows (no visible condition) vs one visible zero token: max diff = {d2:.3e}")
print(f"cached CFG greedy with delay pattern vs recompute: max logit diff = {d3:.3e}, same codes: {torch.equal(seq_c, seq_r)}")
assert d1 < 1e-12 and d2 < 1e-12 and d3 < 1e-12 and torch.equal(seq_c, seq_r)
