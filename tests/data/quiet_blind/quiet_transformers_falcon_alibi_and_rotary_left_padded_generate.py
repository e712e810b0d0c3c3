"""Falcon batched greedy generation from LEFT-padded prompts, with the KV cache.

Uses huggingface/transformers' own Falcon code (installed 5.25.0), tiny models built from
FalconConfig (random weights, no download):
  src/transformers/models/falcon/modeling_falcon.py
    build_alibi_tensor   -- per-key ALiBi from the padding mask: ((mask.cumsum(-1) - 1) * mask) * slope,
                            so every row's key positions count from its first real token;
    FalconModel.forward  -- create_causal_mask(...) materialised (allow_is_causal_skip=False), turned
                            into an additive float mask, then alibi / sqrt(head_dim) is written where the
                            mask is open and finfo.min where it is closed (masked_fill(..., mask < -1, min));
    FalconAttention      -- rotary (non-alibi) variants get positions from position_ids, which
                            generate() derives from the mask (cumsum - 1, pads set to 1).

Two architectures, as the Falcon family ships them:
  * falcon-rw style: alibi=True, multi_query=False, parallel_attn=False, bias=True;
  * falcon-7b style: rotary, multi_query=True (one shared K/V head), parallel_attn=True.
Each is run with attn_implementation "eager" and "sdpa".

Check: the batched left-padded generate must equal each prompt generated alone (no padding),
token for token, and the per-step scores must agree.
"""
import torch
from transformers import FalconConfig, FalconForCausalLM

PAD = 0
PROMPTS = [[11, 4, 27, 9, 31, 6], [17, 3], [8, 22, 40, 5]]
NEW_TOKENS = 6


def build(alibi, attn_impl):
    torch.manual_seed(0)
    if alibi:
        cfg = FalconConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           alibi=True, multi_query=False, parallel_attn=False, bias=True,
                           new_decoder_architecture=False, pad_token_id=PAD, bos_token_id=1,
                           eos_token_id=2, max_position_embeddings=64)
    else:
        cfg = FalconConfig(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           alibi=False, multi_query=True, parallel_attn=True, bias=False,
                           new_decoder_architecture=False, pad_token_id=PAD, bos_token_id=1,
                           eos_token_id=2, max_position_embeddings=64)
    cfg._attn_implementation = attn_impl
    model = FalconForCausalLM(cfg).eval()
    # random init is small; widen the weights so the argmax path is decisive
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model


def left_pad(prompts):
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    return ids, mask


@torch.no_grad()
def run(model):
    ids, mask = left_pad(PROMPTS)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=PAD, eos_token_id=None, use_cache=True,
                         return_dict_in_generate=True, output_scores=True)
    L = ids.shape[1]
    ok = True
    for b, p in enumerate(PROMPTS):
        alone_ids = torch.tensor([p])
        alone = model.generate(input_ids=alone_ids, attention_mask=torch.ones_like(alone_ids),
                               max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=PAD, eos_token_id=None, use_cache=True,
                               return_dict_in_generate=True, output_scores=True)
        got = out.sequences[b, L:].tolist()
        want = alone.sequences[0, len(p):].tolist()
        diff = max(float((out.scores[t][b] - alone.scores[t][0]).abs().max()) for t in range(NEW_TOKENS))
        match = got == want and diff < 1e-3
        ok &= match
        print(f'  row {b} (prompt {len(p)}, left-padded to {L}): batched={got} alone={want} '
              f'scores max|diff|={diff:.2e} match={match}')
    return ok


def main():
    ok_all = True
    for alibi in (True, False):
        for impl in ('eager', 'sdpa'):
            model = build(alibi, impl)
            print(f'falcon {"alibi (rw)" if alibi else "rotary multi-query (7b)"} / {impl}:')
            ok_all &= run(model)
    print('ALL MATCH' if ok_all else 'MISMATCH')
    assert ok_all


if __name__ == '__main__':
    main()
