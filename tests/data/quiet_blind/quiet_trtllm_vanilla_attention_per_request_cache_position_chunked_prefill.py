# Correct program (quiet batch quiet-r82a).
# Citation: NVIDIA/TensorRT-LLM tensorrt_llm/_torch/attention_backend/vanilla.py
#   @026422ca8d3c9fe234f8f481fc4da7fe64130438 (repeat_kv, generate_causal_mask, VanillaAttentionMetadata.prepare,
#   VanillaAttention._single_request_update_kv_cache / _single_request_forward / forward).
# TensorRT-LLM's PyTorch-flow reference backend: the packed tokens of an in-flight batch are split per request by
# metadata.seq_lens / seq_lens_kv; each request writes its new K/V into its cache block at
# cache_position = arange(past_seen_token, past_seen_token + kv_len) (index_copy_ through an integer view) and reads
# back the first target_seq_len rows. The mask follows the request's state: a first prefill (past_seen_token == 0)
# runs SDPA with is_causal=True, a context chunk after cached tokens gets generate_causal_mask's boolean
# (arange(target) <= cache_position), a one-token generation step gets no mask.
# Adaptation: the KV cache manager is a small stand-in holding one buffer per layer, shaped
# (blocks, 2, tokens_per_block, kv_heads, head_dim), with one block per request (vanilla reads block_ids[0]); the
# executor is a four-step in-flight batch mixing context chunks and generation requests.
# Self-check: every token's output equals a per-request double loop over query position and key position 0..t.
import enum

import torch


class PredefinedAttentionMask(str, enum.Enum):
    CAUSAL = "causal"
    FULL = "full"


AttentionMask = PredefinedAttentionMask


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def generate_causal_mask(batch_size: int, target_length: int, cache_position: torch.Tensor, device: torch.device):
    causal_mask = torch.arange(target_length, device=device).unsqueeze(0) <= cache_position.unsqueeze(-1)
    causal_mask = causal_mask.expand(batch_size, 1, -1, -1)
    return causal_mask


class KVCacheParams:
    def __init__(self, num_cached_tokens_per_seq):
        self.num_cached_tokens_per_seq = num_cached_tokens_per_seq


class KVCacheManager:
    """Stand-in for tensorrt_llm's KVCacheManager: one block of tokens_per_block slots per request."""

    def __init__(self, num_layers, num_blocks, tokens_per_block, num_kv_heads, head_dim):
        self.buffers = [torch.zeros(num_blocks, 2, tokens_per_block, num_kv_heads, head_dim)
                        for _ in range(num_layers)]
        self.free = list(range(num_blocks - 1, -1, -1))
        self.blocks = {}

    def add_request(self, request_id):
        self.blocks[request_id] = [self.free.pop()]

    def get_batch_cache_indices(self, request_ids):
        return [self.blocks[r] for r in request_ids]

    def get_buffers(self, layer_idx):
        return self.buffers[layer_idx]


class VanillaAttentionMetadata:
    def __init__(self, *, seq_lens, kv_cache_manager, request_ids, kv_cache_params):
        self.seq_lens = seq_lens
        self.seq_lens_kv = seq_lens
        self.kv_cache_manager = kv_cache_manager
        self.request_ids = request_ids
        self.kv_cache_params = kv_cache_params
        self.is_dummy_attention = False

    def prepare(self) -> None:
        assert self.request_ids is not None
        self.block_ids_per_seq = self.kv_cache_manager.get_batch_cache_indices(
            self.request_ids) if self.kv_cache_manager is not None else None


class VanillaAttention:
    Metadata = VanillaAttentionMetadata
    _access_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

    def __init__(self, layer_idx, num_heads, head_dim, num_kv_heads=None, quant_config=None):
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.quant_config = quant_config
        self.num_key_value_groups = self.num_heads // self.num_kv_heads

    def _single_request_update_kv_cache(self, k, v, kv_cache_tensor, seq_len, cache_idx, cache_position):
        k_out = kv_cache_tensor[cache_idx, 0, :, :, :].unsqueeze(0)
        v_out = kv_cache_tensor[cache_idx, 1, :, :, :].unsqueeze(0)
        if k is not None and v is not None:
            access_type = self._access_type[k.dtype.itemsize]
            k_out.view(dtype=access_type).index_copy_(1, cache_position, k.view(dtype=access_type))
            v_out.view(dtype=access_type).index_copy_(1, cache_position, v.view(dtype=access_type))
        return k_out[:, :seq_len, :, :], v_out[:, :seq_len, :, :]

    def _single_request_forward(self, q, k, v, attention_mask, kv_cache_tensor, past_seen_token, cache_idx):
        bsz = 1
        q_len = q.size(0)
        q = q.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        target_seq_len = past_seen_token
        if k is not None and v is not None:
            kv_len = k.size(0)
            k = k.view(bsz, kv_len, self.num_kv_heads, self.head_dim)
            v = v.view(bsz, kv_len, self.num_kv_heads, self.head_dim)
            target_seq_len += kv_len
            assert k.dtype == v.dtype == kv_cache_tensor.dtype

        cache_position = torch.arange(past_seen_token, target_seq_len, device=q.device)

        key_states, value_states = self._single_request_update_kv_cache(k, v, kv_cache_tensor, target_seq_len,
                                                                        cache_idx, cache_position)
        key_states = key_states.transpose(1, 2).to(q.dtype)
        value_states = value_states.transpose(1, 2).to(q.dtype)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        is_causal = False
        attn_mask = None
        if attention_mask == PredefinedAttentionMask.CAUSAL:
            if past_seen_token == 0:
                is_causal = True
            elif q_len != 1:
                # attn_mask: 4-D tensor (batch_size, 1, query_seq_len, seq_len)
                attn_mask = generate_causal_mask(bsz, target_seq_len, cache_position, q.device)
        elif attention_mask == PredefinedAttentionMask.FULL:
            pass
        else:
            raise ValueError("Unexpected attention mask type")

        attn_output = torch.nn.functional.scaled_dot_product_attention(
            q, key_states, value_states, is_causal=is_causal, attn_mask=attn_mask)
        attn_output = attn_output.squeeze(0)
        return attn_output

    def forward(self, q, k, v, metadata, *, attention_mask=PredefinedAttentionMask.CAUSAL, **kwargs):
        past_seen_tokens = metadata.kv_cache_params.num_cached_tokens_per_seq
        cache_indices = [block_ids[0] for block_ids in metadata.block_ids_per_seq]
        kv_cache_tensor = metadata.kv_cache_manager.get_buffers(self.layer_idx)

        q_len = q.size(0)
        assert len(cache_indices) == len(past_seen_tokens)
        assert len(cache_indices) == metadata.seq_lens.nelement()

        offset = 0
        offset_kv = 0
        attn_outputs = []
        for i, (seq_len, seq_len_kv) in enumerate(zip(metadata.seq_lens, metadata.seq_lens_kv)):
            single_q = q[offset:offset + seq_len]
            single_k = k[offset_kv:offset_kv + seq_len_kv] if k is not None and seq_len_kv != 0 else None
            single_v = v[offset_kv:offset_kv + seq_len_kv] if k is not None and seq_len_kv != 0 else None
            past_seen_token = past_seen_tokens[i]
            cache_idx = cache_indices[i]
            attn_output = self._single_request_forward(single_q, single_k, single_v, attention_mask,
                                                       kv_cache_tensor, past_seen_token, cache_idx)
            attn_outputs.append(attn_output)
            offset += seq_len
            offset_kv += seq_len_kv

        attn_output = torch.cat(attn_outputs, dim=1)
        attn_output = attn_output.transpose(0, 1).contiguous()
        attn_output = attn_output.view(q_len, -1)
        return attn_output


# ---------------------------------------------------------------------------------------------------------------
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 32, 4, 2, 8, 2
TOKENS_PER_BLOCK, NUM_BLOCKS = 48, 6


class DecoderLayer(torch.nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(HIDDEN, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
        self.o_proj = torch.nn.Linear(NUM_HEADS * HEAD_DIM, HIDDEN)
        self.attn = VanillaAttention(layer_idx, NUM_HEADS, HEAD_DIM, NUM_KV_HEADS)

    def qkv(self, x):
        return self.qkv_proj(x).split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1)

    def forward(self, x, attn_metadata):
        q, k, v = self.qkv(x)
        return x + self.o_proj(self.attn.forward(q, k, v, attn_metadata,
                                                 attention_mask=PredefinedAttentionMask.CAUSAL))

    def reference(self, x):
        q, k, v = self.qkv(x)
        n = x.shape[0]
        q = q.view(n, NUM_HEADS, HEAD_DIM)
        k = k.view(n, NUM_KV_HEADS, HEAD_DIM)
        v = v.view(n, NUM_KV_HEADS, HEAD_DIM)
        out = torch.zeros(n, NUM_HEADS, HEAD_DIM)
        rep = NUM_HEADS // NUM_KV_HEADS
        for t in range(n):
            for h in range(NUM_HEADS):
                scores = torch.stack([q[t, h] @ k[j, h // rep] for j in range(t + 1)]) * HEAD_DIM ** -0.5
                p = scores.softmax(0)
                out[t, h] = sum(p[j] * v[j, h // rep] for j in range(t + 1))
        return x + self.o_proj(out.reshape(n, -1))


def main():
    torch.manual_seed(0)
    layers = [DecoderLayer(i) for i in range(NUM_LAYERS)]
    lens = {101: 20, 102: 30, 103: 8, 104: 12}
    streams = {r: torch.randn(n, HIDDEN) for r, n in lens.items()}
    # each step: (request_id, number of new tokens); context chunks and generation steps in one batch
    schedule = [
        [(101, 17), (102, 10)],                  # 101 context, 102 first context chunk
        [(102, 12), (103, 6), (101, 1)],         # 102 second chunk, 103 joins, 101 generates
        [(102, 6), (104, 11), (101, 1), (103, 1)],
        [(102, 2), (101, 1), (103, 1), (104, 1)],  # 102's last chunk of two tokens
    ]
    manager = KVCacheManager(NUM_LAYERS, NUM_BLOCKS, TOKENS_PER_BLOCK, NUM_KV_HEADS, HEAD_DIM)
    cached = {r: 0 for r in lens}
    outs = {r: [] for r in lens}
    with torch.no_grad():
        for step in schedule:
            request_ids = [r for r, _ in step]
            for r in request_ids:
                if r not in manager.blocks:
                    manager.add_request(r)
            metadata = VanillaAttentionMetadata(
                seq_lens=torch.tensor([n for _, n in step], dtype=torch.int32),
                kv_cache_manager=manager,
                request_ids=request_ids,
                kv_cache_params=KVCacheParams([cached[r] for r in request_ids]),
            )
            metadata.prepare()
            h = torch.cat([streams[r][cached[r]:cached[r] + n] for r, n in step])
            for layer in layers:
                h = layer(h, metadata)
            off = 0
            for r, n in step:
                outs[r].append(h[off:off + n])
                off += n
                cached[r] += n

        for r, x in streams.items():
            ref = x
            for layer in layers:
                ref = layer.reference(ref)
            got = torch.cat(outs[r])
            assert got.shape[0] == cached[r]
            torch.testing.assert_close(got, ref[:got.shape[0]], atol=1e-5, rtol=1e-5)
    print("TensorRT-LLM VanillaAttention in-flight batch (context, chunked context, generation) matches "
          "per-request double loops")


if __name__ == "__main__":
    main()
