"""EasyContext USP (Ulysses x ring): zigzag-sharded inputs fed to yunchang's *basic* ring attention.

Citation: jzhang38/EasyContext commit be9a12a ("fix some bugs", 2024-09-14), which follows the USP
path added in dd9f2b6 (easy_context/usp/monkey_patch.py, easy_context/usp/prepare_inputs.py), with
yunchang (feifeibear/long-context-attention, v0.3.x: LongContextAttention, ring_flash_attn_func,
zigzag_ring_flash_attn_func, zigzag_extract_local).

The bug: ``prepare_usp_attn_inputs`` shards input_ids / position_ids / target_ids with yunchang's
``zigzag_extract_local`` (ring rank r holds sequence chunks r and 2*rd-1-r of 2*rd chunks, for load
balance), but the patched attention was built as ``usp_attn = LongContextAttention()``, whose
default ``ring_impl_type`` is "basic": the plain ring that takes rank r's tokens to be the r-th
contiguous chunk (causal inside its own block, whole blocks from lower ranks, nothing from higher
ranks). With zigzag shards the causal structure between chunks is wrong: rank 0's last chunk never
sees the middle chunks, and rank 1's chunks see the last chunk of the sequence.

The fix: ``usp_attn = LongContextAttention(ring_impl_type="zigzag")``.

Kept as the projects wrote it: the monkey-patched ``_flash_attention_forward`` calling
``usp_attn(q, k, v, dropout, softmax_scale, causal=causal)``, yunchang's RING_IMPL_DICT and the two
ring forwards (flash-attn (b, s, h, d) layout, out/lse merge with sigmoid / logsigmoid), the
zigzag extraction, train.py's arange position_ids and the loss reduced as a mean over ranks. Sizes
are tiny (1-layer LLaMA from LlamaConfig, random weights, 16 tokens, ring degree 2, ulysses degree
1); the ranks run as a loop in one process and the ring's send/recv reads the other ranks' K/V from
a list. flash-attn's forward is a plain-torch stand-in returning (out, lse). The same commit also
reordered prepare_usp_attn_inputs' arguments and added a truncation of position_ids to the local
length before extracting them; both runs here extract the full position_ids (dd9f2b6's way) so
that the only difference is the ring implementation.
"""

import math
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------------------------------------
# flash-attn stand-in: _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal) -> out, lse
# q, k, v: (batch, seqlen, nheads, headdim); lse: (batch, nheads, seqlen_q)
# ---------------------------------------------------------------------------------------------
def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal):
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-2, -1)) * softmax_scale
    if causal:
        sq, sk = scores.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), vh)
    return out.transpose(1, 2).to(q.dtype), lse


# ---------------------------------------------------------------------------------------------
# yunchang/ring/utils.py
# ---------------------------------------------------------------------------------------------
def _update_out_and_lse(out, lse, block_out, block_lse):
    block_out = block_out.to(torch.float32)
    block_lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    out = out - F.sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - F.logsigmoid(lse - block_lse)
    return out, lse


def update_out_and_lse(out, lse, block_out, block_lse, slice_=None):
    if out is None:
        if slice_ is not None:
            raise RuntimeError("first update_out_and_lse should not pass slice_ args")
        out = block_out.to(torch.float32)
        lse = block_lse.transpose(-2, -1).unsqueeze(dim=-1)
    elif slice_ is not None:
        slice_out, slice_lse = out[slice_], lse[slice_]
        slice_out, slice_lse = _update_out_and_lse(slice_out, slice_lse, block_out, block_lse)
        out[slice_], lse[slice_] = slice_out, slice_lse
    else:
        out, lse = _update_out_and_lse(out, lse, block_out, block_lse)
    return out, lse


class RingComm:
    """The ring's P2P exchange, for ranks run in one loop: rank r's k/v travel to r+1 each step."""

    def __init__(self, process_group):
        self.rank = process_group.rank
        self.world_size = process_group.size
        self._kv = process_group.kv_store
        self._step = 0

    def send_recv_kv(self, k, v):
        self._step += 1
        src = (self.rank - self._step) % self.world_size
        return self._kv[src]


class SimRingGroup:
    def __init__(self, rank, size, kv_store):
        self.rank, self.size, self.kv_store = rank, size, kv_store


# ---------------------------------------------------------------------------------------------
# yunchang/ring/ring_flash_attn.py
# ---------------------------------------------------------------------------------------------
def ring_flash_attn_forward(process_group, q, k, v, softmax_scale, dropout_p=0, causal=True):
    comm = RingComm(process_group)
    out = None
    lse = None
    next_k, next_v = None, None
    for step in range(comm.world_size):
        if step + 1 != comm.world_size:
            next_k, next_v = comm.send_recv_kv(k, v)
        if not causal or step <= comm.rank:
            block_out, block_lse = _flash_attn_forward(
                q, k, v, dropout_p, softmax_scale, causal=causal and step == 0
            )
            out, lse = update_out_and_lse(out, lse, block_out, block_lse)
        if step + 1 != comm.world_size:
            k, v = next_k, next_v
    out = out.to(q.dtype)
    lse = lse.squeeze(dim=-1).transpose(1, 2)
    return out, lse


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, group=None):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    out, _ = ring_flash_attn_forward(group, q, k, v, softmax_scale, dropout_p, causal)
    return out


# ---------------------------------------------------------------------------------------------
# yunchang/ring/zigzag_ring_flash_attn.py
# ---------------------------------------------------------------------------------------------
def zigzag_ring_flash_attn_forward(process_group, q, k, v, softmax_scale, dropout_p=0, causal=True):
    assert causal is True, "zigzag ring is meaningless for causal=False"
    comm = RingComm(process_group)
    block_seq_len = q.shape[1] // 2
    q1 = q[:, block_seq_len:]
    out = None
    lse = None
    next_k, next_v = None, None

    def forward(q, k, v, causal):
        return _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal=causal)

    for step in range(comm.world_size):
        if step + 1 != comm.world_size:
            next_k, next_v = comm.send_recv_kv(k, v)
        if step == 0:
            block_out, block_lse = forward(q, k, v, causal=True)
            out, lse = update_out_and_lse(out, lse, block_out, block_lse)
        elif step <= comm.rank:
            k0 = k[:, :block_seq_len]
            v0 = v[:, :block_seq_len]
            block_out, block_lse = forward(q, k0, v0, causal=False)
            out, lse = update_out_and_lse(out, lse, block_out, block_lse)
        else:
            block_out, block_lse = forward(q1, k, v, causal=False)
            out, lse = update_out_and_lse(
                out, lse, block_out, block_lse, slice_=(slice(None), slice(block_seq_len, None))
            )
        if step + 1 != comm.world_size:
            k, v = next_k, next_v
    out = out.to(q.dtype)
    lse = lse.squeeze(dim=-1).transpose(1, 2)
    return out, lse


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, group=None):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    out, _ = zigzag_ring_flash_attn_forward(group, q, k, v, softmax_scale, dropout_p, causal)
    return out


RING_IMPL_DICT = {
    "basic": ring_flash_attn_func,
    "zigzag": zigzag_ring_flash_attn_func,
}


# ---------------------------------------------------------------------------------------------
# yunchang/hybrid/attn_layer.py (ulysses degree 1 here: the all-to-alls are the identity)
# ---------------------------------------------------------------------------------------------
class LongContextAttention(torch.nn.Module):
    def __init__(self, scatter_idx=2, gather_idx=1, ring_impl_type="basic", use_pack_qkv=False):
        super().__init__()
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.use_pack_qkv = use_pack_qkv
        self.ring_pg = None  # set_seq_parallel_pg; here the simulated ring group of the current rank
        self.ring_attn_fn = RING_IMPL_DICT[ring_impl_type]

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False):
        out = self.ring_attn_fn(
            query, key, value, dropout_p=dropout_p, softmax_scale=softmax_scale,
            causal=causal, group=self.ring_pg,
        )
        return out


# easy_context/usp/monkey_patch.py
if FIXED:
    usp_attn = LongContextAttention(ring_impl_type="zigzag")
else:
    usp_attn = LongContextAttention()


def new_flash_attn_forward(query_states, key_states, value_states, attention_mask, query_length,
                           dropout=0.0, softmax_scale=None, use_sliding_windows=False, is_causal=True):
    causal = is_causal
    assert attention_mask is None
    assert causal is True
    assert use_sliding_windows is False
    attn_output = usp_attn(query_states, key_states, value_states, dropout, softmax_scale, causal=causal)
    return attn_output


# ---------------------------------------------------------------------------------------------
# yunchang/comm/extract_local.py zigzag_extract_local (ring / ulysses ranks passed in)
# ---------------------------------------------------------------------------------------------
def zigzag_extract_local(value, rank, world_size, rd, ud, dim=1):
    batch_size, seqlen, *rest = value.shape
    value_chunks = value.chunk(2 * rd, dim=dim)
    r_rank = rank // ud
    u_rank = rank % ud
    local_value = torch.cat(
        [value_chunks[r_rank], value_chunks[2 * rd - r_rank - 1]], dim=dim
    ).chunk(ud, dim=dim)[u_rank]
    new_shape = [batch_size, seqlen // world_size] + rest
    return local_value.reshape(new_shape).contiguous()


# easy_context/usp/prepare_inputs.py
def prepare_usp_attn_inputs(input_ids, position_ids, target_ids, rank, world_size, device,
                            ring_degree, ulysses_degree):
    local_input_ids = zigzag_extract_local(input_ids, rank, world_size, ring_degree, ulysses_degree).to(device)
    local_position_ids = zigzag_extract_local(position_ids, rank, world_size, ring_degree, ulysses_degree).to(device)
    if target_ids is not None:
        local_target_ids = zigzag_extract_local(target_ids, rank, world_size, ring_degree, ulysses_degree).to(device)
    else:
        local_target_ids = None
    return {
        "local_input_ids": local_input_ids,
        "local_position_ids": local_position_ids,
        "local_target_ids": local_target_ids,
    }


# ---------------------------------------------------------------------------------------------
# A 1-layer LLaMA (LlamaFlashAttention2's projections and rotary), run rank by rank
# ---------------------------------------------------------------------------------------------
def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    llama = model.model
    layer = llama.layers[0]
    attn = layer.self_attn
    n_heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads

    world_size, ring_degree, ulysses_degree = 2, 2, 1
    seq_length = 16
    batch_ids = torch.randint(0, config.vocab_size, (1, seq_length + 1))
    input_ids = batch_ids[..., : seq_length + 1][..., :-1]
    target_ids = batch_ids[..., : seq_length + 1][..., 1:]
    position_ids = torch.arange(seq_length).unsqueeze(0).expand(input_ids.shape[0], -1)

    prepared, states = [], []
    kv_store = []
    with torch.no_grad():
        for rank in range(world_size):
            p = prepare_usp_attn_inputs(input_ids, position_ids, target_ids, rank, world_size,
                                        "cpu", ring_degree, ulysses_degree)
            prepared.append(p)
            hidden = llama.embed_tokens(p["local_input_ids"])
            residual = hidden
            h = layer.input_layernorm(hidden)
            bsz, q_len, _ = h.shape
            q = attn.q_proj(h).view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
            cos, sin = llama.rotary_emb(v, p["local_position_ids"])
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            # flash-attn layout (batch, seqlen, nheads, headdim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            states.append((residual, q, bsz, q_len))
            kv_store.append((k, v))

        losses = []
        for rank in range(world_size):
            residual, q, bsz, q_len = states[rank]
            k, v = kv_store[rank]
            usp_attn.ring_pg = SimRingGroup(rank, ring_degree, kv_store)
            attn_output = new_flash_attn_forward(q, k, v, None, q_len, dropout=0.0, softmax_scale=None)
            attn_output = attn_output.reshape(bsz, q_len, -1)
            hidden = residual + attn.o_proj(attn_output)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            logits = model.lm_head(llama.norm(hidden))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   prepared[rank]["local_target_ids"].reshape(-1))
            losses.append(loss)
            print(f"rank {rank}: positions {prepared[rank]['local_position_ids'].tolist()[0]} "
                  f"loss {loss.item():.6f}")

    gathered_loss = torch.stack(losses).mean()
    print(f"loss (mean over ranks) {gathered_loss.item():.6f} ppl {math.exp(gathered_loss.item()):.4f}")


if __name__ == "__main__":
    main()
