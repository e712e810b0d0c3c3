"""vllm-project/vllm-omni#4767 (closes #4671): in RingAttentionFunc with causal=True and
joint_strategy="front", step 0 concatenates [joint, local] keys and calls the kernel with causal=True,
so the top-left causal mask is laid over the joint prefix: local query i sees joint[:i+1] and only the
local keys before i - J, instead of all joint tokens plus local keys <= i.
(Reduced: the ring is simulated by a loop over ranks; joint K/V join the step-0 block only.)"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

WORLD_SIZE = 4
LOCAL_LEN = 6
JOINT_LEN = 3
NUM_HEADS = 2
HEAD_DIM = 8


def pytorch_attn_forward(q, k, v, softmax_scale, causal):
    # q, k, v: [B, S, H, D] -> SDPA layout [B, H, S, D]; returns out [B, S, H, D] and lse [B, H, S]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale)
    scores = qt @ kt.transpose(-1, -2) * softmax_scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return out.transpose(1, 2), lse


def update_out_and_lse(out, lse, block_out, block_lse):
    if out is None:
        return block_out.float(), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    w_old = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse


def ring_attention_forward(rank, q, ks, vs, sm_scale, is_causal, joint_tensor_key, joint_tensor_value,
                           joint_strategy="front"):
    out, lse = None, None
    for step in range(WORLD_SIZE):
        src = (rank - step) % WORLD_SIZE  # the K/V block received at this step
        k, v = ks[src], vs[src]
        if not is_causal or step <= rank:
            step_k, step_v = k, v
            if joint_tensor_key is not None and step == 0:
                if FIXED and is_causal and joint_strategy == "front":
                    # joint prefix: visible to every query, no causal mask
                    block_out, block_lse = pytorch_attn_forward(q, joint_tensor_key, joint_tensor_value,
                                                                sm_scale, causal=False)
                    out, lse = update_out_and_lse(out, lse, block_out, block_lse)
                else:
                    step_k = torch.cat([joint_tensor_key, step_k], dim=1)
                    step_v = torch.cat([joint_tensor_value, step_v], dim=1)
            block_out, block_lse = pytorch_attn_forward(q, step_k, step_v, sm_scale, causal=is_causal and step == 0)
            out, lse = update_out_and_lse(out, lse, block_out, block_lse)
    return out.to(q.dtype)


def main():
    seq = WORLD_SIZE * LOCAL_LEN
    q = torch.randn(1, seq, NUM_HEADS, HEAD_DIM)
    k = torch.randn(1, seq, NUM_HEADS, HEAD_DIM)
    v = torch.randn(1, seq, NUM_HEADS, HEAD_DIM)
    jk = torch.randn(1, JOINT_LEN, NUM_HEADS, HEAD_DIM)
    jv = torch.randn(1, JOINT_LEN, NUM_HEADS, HEAD_DIM)
    sm_scale = HEAD_DIM ** -0.5

    qs, ks, vs = q.chunk(WORLD_SIZE, 1), k.chunk(WORLD_SIZE, 1), v.chunk(WORLD_SIZE, 1)
    outs = [ring_attention_forward(r, qs[r], ks, vs, sm_scale, True, jk, jv, "front") for r in range(WORLD_SIZE)]
    ring_out = torch.cat(outs, dim=1)

    # reference: joint tokens are a prefix every image/text token may attend to; causal among the rest
    full_k = torch.cat([jk, k], 1).transpose(1, 2)
    full_v = torch.cat([jv, v], 1).transpose(1, 2)
    allowed = torch.ones(seq, JOINT_LEN + seq, dtype=torch.bool)
    allowed[:, JOINT_LEN:] = torch.ones(seq, seq, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), full_k, full_v, attn_mask=allowed, scale=sm_scale)
    diff = (ring_out - ref.transpose(1, 2)).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: max |ring attention - reference (joint prefix + causal)| = {diff:.4e}")


if __name__ == "__main__":
    main()
