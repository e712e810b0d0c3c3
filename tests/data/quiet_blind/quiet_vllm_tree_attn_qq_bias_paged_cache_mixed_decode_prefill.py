# Citation: vllm-project/vllm @00c457b61cf7383d063e9b652228a07c01a6473a:
#   vllm/v1/attention/backends/tree_attn.py (TreeAttentionMetadataBuilder.__init__/build, _get_depth_counts,
#   _prepare_tree_attn_bias, TreeAttentionMetadata.prefill_metadata/decode_metadata, TreeAttentionImpl.forward),
#   vllm/v1/attention/backends/utils.py (split_decodes_and_prefills, decode_threshold = tree length),
#   vllm/attention/ops/triton_unified_attention.py @001ceb3e98e7a19ebe33f542a368fa73bf6c76ad
#   (kernel_unified_attention_2d: seq_mask = seq_offset < context_len + query_pos + 1, qq_bias loaded at
#   key_rel_pos = seq_offset - context_len for keys inside the query section, 0 for context keys),
#   tests/v1/spec_decode/test_tree_attention.py @038f589aefa4be8a5fd572a1e83167c041f5c4a5 (_gen_slot_mapping,
#   the branch-as-chain reference).
# vLLM V1's TREE_ATTN backend verifying a speculative token tree: the tree's (tree_len x tree_len) float bias
# (0 on the diagonal, on the root column and on every ancestor, -inf elsewhere) is built once from the
# speculative_token_tree string and passed as qq_bias to unified_attention for the decode requests only; the
# kernel keeps its own causal rule over the paged KV cache (context keys always visible). A mixed batch: two
# requests verifying a 10-node tree after 13 and 21 cached tokens, and one chunked-prefill request (11 new tokens
# after 5 cached) that is longer than the tree and so goes down the prefill path with no bias. Paged KV cache with
# randomised block tables, GQA (4 query heads, 2 KV heads). The CUDA kernels (reshape_and_cache_flash,
# unified_attention) are written here in torch, following their index arithmetic.
# Checked, as vLLM's own test does, against every root-to-node branch of the tree run as a plain causal chain
# after the same cached context (a double loop over query/key positions, float64), and the prefill request against
# a plain causal double loop over its context + new tokens.
import ast
import math
from dataclasses import dataclass
from typing import Optional

import torch

torch.manual_seed(0)
DTYPE = torch.float64


# ---- vllm/v1/attention/backends/tree_attn.py
def _get_depth_counts(sorted_tree_choices: list[tuple[int, ...]]) -> list[int]:
    # Count the number of choices at each depth of the tree.
    depth_counts = []
    prev_depth = 0
    for path in sorted_tree_choices:
        depth = len(path)
        if depth != prev_depth:
            depth_counts.append(0)
        depth_counts[depth - 1] += 1
        prev_depth = depth
    return depth_counts


def _prepare_tree_attn_bias(
    sorted_tree_choices: list[tuple[int, ...]],
    depth_counts: list[int],
    dtype: Optional[torch.dtype],
    device: Optional[torch.device],
) -> torch.Tensor:
    # +1 comes from the additional root node.
    tree_len = len(sorted_tree_choices) + 1
    tree_attn_mask = torch.full((tree_len, tree_len), -torch.inf, device=device, dtype=dtype)

    # Set diagonal to all zeros. Each token should
    # attend to itself.
    mask_val = 0
    for i in range(tree_len):
        tree_attn_mask[i, i] = mask_val

    # Set root to all zeros. All tokens attend to it.
    tree_attn_mask[:, 0] = mask_val

    # Set all ancestors to zeros.
    start = 0
    for i in range(len(depth_counts)):
        for j in range(depth_counts[i]):
            cur_tree_choice = sorted_tree_choices[start + j]
            # Retrieve ancestor position.
            if len(cur_tree_choice) == 1:
                continue
            ancestor_idx = []
            for c in range(len(cur_tree_choice) - 1):
                ancestor_idx.append(sorted_tree_choices.index(cur_tree_choice[:c + 1]) + 1)
            tree_attn_mask[j + start + 1, ancestor_idx] = mask_val
        start += depth_counts[i]
    return tree_attn_mask


@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


# ---- vllm/v1/attention/backends/utils.py
def split_decodes_and_prefills(common_attn_metadata: CommonAttentionMetadata, decode_threshold: int = 1):
    max_query_len = common_attn_metadata.max_query_len
    num_reqs = common_attn_metadata.num_reqs
    num_tokens = common_attn_metadata.num_actual_tokens
    query_start_loc = common_attn_metadata.query_start_loc_cpu

    if max_query_len <= decode_threshold:
        return num_reqs, 0, num_tokens, 0

    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_prefill = query_lens > decode_threshold
    if not torch.any(is_prefill):
        return num_reqs, 0, num_tokens, 0

    first_prefill = is_prefill.int().argmax(dim=-1).item()
    assert torch.all(query_lens[first_prefill:] > decode_threshold)
    assert torch.all(query_lens[:first_prefill] <= decode_threshold)
    num_decodes = first_prefill
    num_prefills = num_reqs - num_decodes
    num_decode_tokens = query_start_loc[first_prefill].item()
    num_prefill_tokens = num_tokens - num_decode_tokens
    return (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)


@dataclass
class TreeAttentionMetadata:
    num_actual_tokens: int  # Number of tokens excluding padding.
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    num_decodes: int = 0

    tree_attn_bias: Optional[torch.Tensor] = None

    # Cached Prefill/decode metadata.
    _cached_prefill_metadata: Optional["TreeAttentionMetadata"] = None
    _cached_decode_metadata: Optional["TreeAttentionMetadata"] = None

    @property
    def prefill_metadata(self) -> Optional["TreeAttentionMetadata"]:
        if self.num_prefills == 0:
            return None

        if self._cached_prefill_metadata is not None:
            return self._cached_prefill_metadata

        q_start_loc = self.query_start_loc[self.num_decodes:]
        q_seqlens = torch.diff(q_start_loc)
        kv_seqlens = self.seq_lens[self.num_decodes:]
        # Construct & cache prefill-phase attention metadata structure
        self._cached_prefill_metadata = TreeAttentionMetadata(
            num_actual_tokens=self.num_prefill_tokens,
            max_query_len=int(q_seqlens.max().item()),
            query_start_loc=q_start_loc - q_start_loc[0],
            max_seq_len=int(kv_seqlens.max().item()),
            seq_lens=kv_seqlens,
            block_table=self.block_table[self.num_decodes:],
            slot_mapping=self.slot_mapping[self.num_decode_tokens:],
        )
        return self._cached_prefill_metadata

    @property
    def decode_metadata(self) -> Optional["TreeAttentionMetadata"]:
        if self.num_decode_tokens == 0:
            return None

        if self._cached_decode_metadata is not None:
            return self._cached_decode_metadata

        q_start_loc = self.query_start_loc[:self.num_decodes + 1]
        q_seqlens = torch.diff(q_start_loc)
        kv_seqlens = self.seq_lens[:self.num_decodes]
        # Construct & cache decode-phase attention metadata structure
        self._cached_decode_metadata = TreeAttentionMetadata(
            num_actual_tokens=self.num_decode_tokens,
            max_query_len=int(q_seqlens.max().item()),
            query_start_loc=q_start_loc,
            max_seq_len=int(kv_seqlens.max().item()),
            seq_lens=kv_seqlens,
            block_table=self.block_table[:self.num_decodes],
            slot_mapping=self.slot_mapping[:self.num_decode_tokens],
            tree_attn_bias=self.tree_attn_bias,
        )
        return self._cached_decode_metadata


class TreeAttentionMetadataBuilder:
    def __init__(self, block_size: int, speculative_token_tree: Optional[str], device: torch.device):
        self.block_size = block_size

        spec_token_tree = speculative_token_tree
        tree_choices: list[tuple[int, ...]] = (ast.literal_eval(spec_token_tree)
                                               if spec_token_tree is not None else [(0, )])
        # Construct the tree attention bias.
        depth_counts = _get_depth_counts(tree_choices)
        self.tree_attn_bias = _prepare_tree_attn_bias(
            tree_choices,
            depth_counts,
            dtype=torch.float32,
            device=device,
        )

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TreeAttentionMetadata:
        decode_threshold = self.tree_attn_bias.shape[0]
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = (
            split_decodes_and_prefills(common_attn_metadata, decode_threshold=decode_threshold))

        return TreeAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            num_decodes=num_decodes,
            max_query_len=common_attn_metadata.max_query_len,
            query_start_loc=common_attn_metadata.query_start_loc,
            max_seq_len=common_attn_metadata.max_seq_len,
            seq_lens=common_attn_metadata.seq_lens,
            block_table=common_attn_metadata.block_table_tensor,
            slot_mapping=common_attn_metadata.slot_mapping,
            tree_attn_bias=self.tree_attn_bias,
        )


# ---- vllm/_custom_ops.py reshape_and_cache_flash (CUDA kernel), in torch
def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    block_size = key_cache.shape[1]
    n = slot_mapping.shape[0]
    block_idx = slot_mapping // block_size
    block_offset = slot_mapping % block_size
    key_cache[block_idx, block_offset] = key[:n].to(key_cache.dtype)
    value_cache[block_idx, block_offset] = value[:n].to(value_cache.dtype)


# ---- vllm/attention/ops/triton_unified_attention.py (kernel_unified_attention_2d), in torch
def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                      window_size, block_table, softcap, q_descale, k_descale, v_descale, alibi_slopes=None,
                      qq_bias=None):
    assert causal, "Only causal attention is supported"
    block_size = k.shape[1]
    num_query_heads = q.shape[1]
    num_kv_heads = k.shape[2]
    num_queries_per_kv = num_query_heads // num_kv_heads
    num_seqs = len(seqused_k)
    for seq_idx in range(num_seqs):
        cur_batch_in_all_start_index = int(cu_seqlens_q[seq_idx])
        cur_batch_in_all_stop_index = int(cu_seqlens_q[seq_idx + 1])
        cur_batch_query_len = cur_batch_in_all_stop_index - cur_batch_in_all_start_index
        seq_len = int(seqused_k[seq_idx])
        context_len = seq_len - cur_batch_query_len

        query_pos = torch.arange(cur_batch_query_len)
        seq_offset = torch.arange(seq_len)
        physical_block_idx = block_table[seq_idx, seq_offset // block_size].long()
        K = k[physical_block_idx, seq_offset % block_size]  # (seq_len, kv_heads, D)
        V = v[physical_block_idx, seq_offset % block_size]
        K = K.repeat_interleave(num_queries_per_kv, dim=1)
        V = V.repeat_interleave(num_queries_per_kv, dim=1)
        Q = q[cur_batch_in_all_start_index:cur_batch_in_all_stop_index]  # (q_len, heads, D)

        S = softmax_scale * torch.einsum("qhd,khd->hqk", Q, K)
        if softcap > 0:
            S = softcap * torch.tanh(S / softcap)
        # Standard causal mask
        seq_mask = seq_offset[None, :] < context_len + query_pos[:, None] + 1
        S = torch.where(seq_mask[None], S, float("-inf"))
        if window_size[0] >= 0:
            S = torch.where(((context_len + query_pos[:, None] - seq_offset[None, :]) < window_size[0] + 1)[None],
                            S, float("-inf"))
        if qq_bias is not None:
            # compute key positions relative to query section
            key_rel_pos = seq_offset - context_len
            # load bias only for keys that correspond to queries
            is_query_key = (key_rel_pos >= 0) & (key_rel_pos < qq_bias.shape[1])
            bias = torch.zeros(cur_batch_query_len, seq_len, dtype=S.dtype)
            bias[:, is_query_key] = qq_bias[:cur_batch_query_len, key_rel_pos[is_query_key]].to(S.dtype)
            S = S + bias[None]
        m_j = S.amax(dim=-1, keepdim=True)
        m_j = torch.where(m_j > float("-inf"), m_j, torch.zeros_like(m_j))
        P = torch.exp(S - m_j)
        L = P.sum(dim=-1, keepdim=True)
        acc = torch.einsum("hqk,khd->qhd", P / L, V)
        out[cur_batch_in_all_start_index:cur_batch_in_all_stop_index] = acc.to(out.dtype)


class MockAttentionLayer(torch.nn.Module):
    _q_scale = torch.tensor(1.0, dtype=torch.float32)
    _k_scale = torch.tensor(1.0, dtype=torch.float32)
    _v_scale = torch.tensor(1.0, dtype=torch.float32)


class TreeAttentionImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        self.alibi_slopes = alibi_slopes
        if logits_soft_cap is None:
            # Setting logits_soft_cap to 0 means no soft cap.
            logits_soft_cap = 0
        self.logits_soft_cap = logits_soft_cap
        if sliding_window is None:
            self.sliding_window = (-1, -1)
        else:
            self.sliding_window = (sliding_window - 1, 0)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: TreeAttentionMetadata, output=None):
        assert output is not None, "Output tensor must be provided."
        if attn_metadata is None:
            return output

        # Cache the input KVs.
        key_cache, value_cache = kv_cache.unbind(0)
        if self.kv_sharing_target_layer_name is None:
            reshape_and_cache_flash(key, value, key_cache, value_cache, attn_metadata.slot_mapping,
                                    self.kv_cache_dtype, layer._k_scale, layer._v_scale)

        num_actual_tokens = attn_metadata.num_actual_tokens
        num_decode_tokens = attn_metadata.num_decode_tokens
        descale_shape = (attn_metadata.query_start_loc.shape[0] - 1, key.shape[1])
        if prefill_meta := attn_metadata.prefill_metadata:
            unified_attention(
                q=query[num_decode_tokens:num_actual_tokens],
                k=key_cache,
                v=value_cache,
                out=output[num_decode_tokens:num_actual_tokens],
                cu_seqlens_q=prefill_meta.query_start_loc,
                max_seqlen_q=prefill_meta.max_query_len,
                seqused_k=prefill_meta.seq_lens,
                max_seqlen_k=prefill_meta.max_seq_len,
                softmax_scale=self.scale,
                causal=True,
                alibi_slopes=self.alibi_slopes,
                window_size=self.sliding_window,
                block_table=prefill_meta.block_table,
                softcap=self.logits_soft_cap,
                q_descale=None,  # Not supported
                k_descale=layer._k_scale.expand(descale_shape),
                v_descale=layer._v_scale.expand(descale_shape),
            )

        if decode_meta := attn_metadata.decode_metadata:
            unified_attention(
                q=query[:num_decode_tokens],
                k=key_cache,
                v=value_cache,
                out=output[:num_decode_tokens],
                cu_seqlens_q=decode_meta.query_start_loc,
                max_seqlen_q=decode_meta.max_query_len,
                seqused_k=decode_meta.seq_lens,
                max_seqlen_k=decode_meta.max_seq_len,
                softmax_scale=self.scale,
                causal=True,
                alibi_slopes=self.alibi_slopes,
                qq_bias=decode_meta.tree_attn_bias,
                window_size=self.sliding_window,
                block_table=decode_meta.block_table,
                softcap=self.logits_soft_cap,
                q_descale=None,  # Not supported
                k_descale=layer._k_scale.expand(descale_shape),
                v_descale=layer._v_scale.expand(descale_shape),
            )
        return output


# ---- tests/v1/spec_decode/test_tree_attention.py
def _gen_slot_mapping(positions: torch.Tensor, block_table: torch.Tensor, block_size: int):
    block_indices = positions // block_size
    blocks = block_table.gather(dim=1, index=block_indices)
    return (blocks * block_size + positions % block_size).view(-1)


# ---- reference: plain causal attention by a double loop (no cache, no bias)
def chain_attention(q, k, v, scale):
    # q: (n_q, H, D) are the last n_q positions of k/v: (n_k, KVH, D)
    n_q, H, D = q.shape
    n_k, KVH, _ = k.shape
    rep = H // KVH
    out = torch.zeros(n_q, H, D, dtype=q.dtype)
    for i in range(n_q):
        qpos = n_k - n_q + i
        for h in range(H):
            scores = []
            for j in range(qpos + 1):
                scores.append(scale * torch.dot(q[i, h], k[j, h // rep]))
            w = torch.softmax(torch.stack(scores), dim=0)
            out[i, h] = sum(w[j] * v[j, h // rep] for j in range(qpos + 1))
    return out


def main():
    speculative_token_tree = str(sorted(
        [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0)], key=lambda x: (len(x), x)))
    tree_choices = ast.literal_eval(speculative_token_tree)
    tree_len = len(tree_choices) + 1

    num_heads, num_kv_heads, head_size = 4, 2, 16
    block_size = 16
    max_blocks_per_req = 4
    scale = head_size ** -0.5

    # requests already ordered decodes-first (reorder_batch_to_split_decodes_and_prefills)
    context_lens = [13, 21, 5]
    query_lens = [tree_len, tree_len, 11]
    seq_lens_list = [c + q for c, q in zip(context_lens, query_lens)]
    num_reqs = len(context_lens)

    num_blocks = num_reqs * max_blocks_per_req
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=DTYPE)
    block_ids = torch.randperm(num_blocks).int()
    block_table = block_ids.view(num_reqs, max_blocks_per_req)

    # the cached context of each request, written by earlier steps at positions 0..context_len-1
    ctx_k = [torch.randn(c, num_kv_heads, head_size, dtype=DTYPE) for c in context_lens]
    ctx_v = [torch.randn(c, num_kv_heads, head_size, dtype=DTYPE) for c in context_lens]
    for r in range(num_reqs):
        positions = torch.arange(context_lens[r]).view(1, -1)
        slots = _gen_slot_mapping(positions, block_table[r:r + 1].long(), block_size)
        reshape_and_cache_flash(ctx_k[r], ctx_v[r], kv_cache[0], kv_cache[1], slots, "auto", None, None)

    # this step's new tokens (tree tokens for the decodes, a chunk for the prefill), flat positions after context
    q = [torch.randn(n, num_heads, head_size, dtype=DTYPE) for n in query_lens]
    k = [torch.randn(n, num_kv_heads, head_size, dtype=DTYPE) for n in query_lens]
    v = [torch.randn(n, num_kv_heads, head_size, dtype=DTYPE) for n in query_lens]
    slot_mapping = torch.cat([
        _gen_slot_mapping((context_lens[r] + torch.arange(query_lens[r])).view(1, -1), block_table[r:r + 1].long(),
                          block_size) for r in range(num_reqs)])

    query_start_loc = torch.zeros(num_reqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(),
        num_reqs=num_reqs,
        num_actual_tokens=int(query_start_loc[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_list),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
    )
    builder = TreeAttentionMetadataBuilder(block_size, speculative_token_tree, torch.device("cpu"))
    attn_metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
    assert attn_metadata.num_decodes == 2 and attn_metadata.num_prefills == 1

    impl = TreeAttentionImpl(num_heads=num_heads, head_size=head_size, scale=scale, num_kv_heads=num_kv_heads,
                             alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    query = torch.cat(q)
    key = torch.cat(k)
    value = torch.cat(v)
    output = torch.empty_like(query)
    impl.forward(MockAttentionLayer(), query, key, value, kv_cache, attn_metadata, output=output)

    # reference 1: each root-to-node branch of the tree as a plain causal chain after the cached context
    parents = {(): 0}
    for i, c in enumerate(tree_choices):
        parents[tuple(c)] = i + 1
    branches = [[0]]
    for c in tree_choices:
        branches.append([0] + [parents[tuple(c[:d + 1])] for d in range(len(c))])
    max_diff = 0.0
    for r in range(2):
        out_r = output[query_start_loc[r]:query_start_loc[r + 1]]
        for node, branch in enumerate(branches):
            idx = torch.tensor(branch)
            kk = torch.cat([ctx_k[r], k[r][idx]])
            vv = torch.cat([ctx_v[r], v[r][idx]])
            ref = chain_attention(q[r][idx], kk, vv, scale)
            diff = (out_r[idx] - ref).abs().max().item()
            max_diff = max(max_diff, diff)
            assert diff < 1e-10, (r, node, diff)

    # reference 2: the chunked prefill request is plain causal attention over context + chunk
    r = 2
    ref = chain_attention(q[r], torch.cat([ctx_k[r], k[r]]), torch.cat([ctx_v[r], v[r]]), scale)
    diff = (output[query_start_loc[r]:query_start_loc[r + 1]] - ref).abs().max().item()
    max_diff = max(max_diff, diff)
    assert diff < 1e-10, diff

    # the tree bias is not a chain: some node must differ from a causal (all-previous-tokens) run
    r = 0
    plain = chain_attention(q[r], torch.cat([ctx_k[r], k[r]]), torch.cat([ctx_v[r], v[r]]), scale)
    assert (output[:tree_len] - plain).abs().max() > 1e-3
    print(f"ok: vLLM TREE_ATTN qq_bias over a paged cache matches every branch run as a chain "
          f"(max diff {max_diff:.2e})")


if __name__ == "__main__":
    main()
