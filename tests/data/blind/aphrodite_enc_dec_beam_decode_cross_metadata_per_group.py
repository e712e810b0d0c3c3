"""Aphrodite engine: encoder-decoder decode metadata has one cross-attention entry per sequence GROUP.

Citation: dphnAI/sonar#1064 (aphrodite-engine, "fix: encoder-decoder models for beam search",
commit 314fa7f), aphrodite/worker/enc_dec_model_runner.py `_prepare_encoder_model_input_tensors`.

Bug: in the decode phase the runner appended `encoder_seq_lens` and `cross_block_tables` once per
`SequenceGroupMetadata`, while the decoder batch has one row per *sequence* (beam search puts
several beams in one group). With CUDA-graph replay the lists are padded up to
`_get_graph_batch_size(len(encoder_seq_lens))` with `encoder_seq_len = 1` and an empty block table,
so nothing fails: beam 1 of a request cross-attends the next request's encoder KV blocks, later rows
shift by one, and the last real row reads one slot of padding block 0.

Fix: append the encoder length and cross block table once per sequence in the group
(`for _ in range(len(seq_group_metadata.seq_data))`).

Reproduction: a BART-sized-down decode step over a paged cross-attention KV cache on CPU. Prefill
writes each request's projected encoder K/V through `cross_slot_mapping`; the decode step builds the
metadata as the runner does and a reference paged-decode kernel gathers each query row's keys
through `cross_block_tables[i]` up to `encoder_seq_lens[i]`. Three requests: one beam-searched with
2 beams, two with one sequence each (4 decode rows -> graph batch size 4).
"""
import itertools
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

_BATCH_SIZE_ALIGNMENT = 8
PAD_SLOT_ID = -1


def _get_graph_batch_size(batch_size: int) -> int:
    if batch_size <= 2:
        return batch_size
    elif batch_size <= 4:
        return 4
    else:
        return ((batch_size + _BATCH_SIZE_ALIGNMENT - 1) //
                _BATCH_SIZE_ALIGNMENT * _BATCH_SIZE_ALIGNMENT)


def make_tensor_with_pad(x: List[List[int]], max_len: int, pad: int, dtype, device):
    padded = [row + [pad] * (max_len - len(row)) for row in x]
    return torch.tensor(padded, dtype=dtype, device=device)


class SequenceData:
    def __init__(self, token_ids: List[int]):
        self._token_ids = list(token_ids)

    def get_len(self) -> int:
        return len(self._token_ids)

    def get_token_ids(self) -> List[int]:
        return self._token_ids

    def get_last_token_id(self) -> int:
        return self._token_ids[-1]


@dataclass
class SequenceGroupMetadata:
    request_id: str
    is_prompt: bool
    seq_data: Dict[int, SequenceData]
    block_tables: Optional[Dict[int, List[int]]]
    encoder_seq_data: SequenceData
    cross_block_table: Optional[List[int]]


@dataclass
class AttentionMetadata:
    use_cuda_graph: bool
    num_encoder_tokens: int = 0
    encoder_seq_lens: Optional[List[int]] = None
    encoder_seq_lens_tensor: Optional[torch.Tensor] = None
    max_encoder_seq_len: int = 0
    cross_slot_mapping: Optional[torch.Tensor] = None
    cross_block_tables: Optional[torch.Tensor] = None


@dataclass
class EncoderDecoderModelInput:
    input_tokens: torch.Tensor
    attn_metadata: AttentionMetadata


class Config:
    vocab_size = 40
    d_model = 32
    decoder_attention_heads = 4
    block_size = 4
    num_blocks = 16
    max_num_blocks_per_seq = 4


class EncoderDecoderModelRunner:
    def __init__(self, config: Config):
        self.block_size = config.block_size
        self.config = config
        self.device = torch.device("cpu")

    def get_max_block_per_batch(self) -> int:
        return self.config.max_num_blocks_per_seq

    def _list_to_long_tensor(self, x):
        return torch.tensor(x, dtype=torch.long, device=self.device)

    def _list_to_int32_tensor(self, x):
        return torch.tensor(x, dtype=torch.int32, device=self.device)

    def _empty_long_tensor(self):
        return self._list_to_long_tensor([])

    def _empty_int32_tensor(self):
        return self._list_to_int32_tensor([])

    def _prepare_encoder_model_input_tensors(self, seq_group_metadata_list, model_input):
        if len(seq_group_metadata_list) == 0:
            return (model_input.attn_metadata, None, None)

        is_prompt = seq_group_metadata_list[0].is_prompt

        encoder_seq_lens: List[int] = []
        if is_prompt:
            cross_block_tables = self._empty_int32_tensor().view(len(seq_group_metadata_list), -1)
            encoder_input_tokens, encoder_input_positions, cross_slot_mapping = [], [], []
            for seq_group_metadata in seq_group_metadata_list:
                seq_len = seq_group_metadata.encoder_seq_data.get_len()
                token_ids = seq_group_metadata.encoder_seq_data.get_token_ids()
                encoder_seq_lens.append(seq_len)

                is_profile_run = (seq_group_metadata.block_tables is None)
                if is_profile_run:
                    cross_slot_mapping.extend([PAD_SLOT_ID] * seq_len)
                else:
                    for i in range(0, seq_len):
                        block_number = seq_group_metadata.cross_block_table[i // self.block_size]
                        block_offset = i % self.block_size
                        slot = block_number * self.block_size + block_offset
                        cross_slot_mapping.append(slot)

                encoder_input_tokens.extend(token_ids)
                encoder_input_positions.extend(list(range(0, seq_len)))

            encoder_input_tokens_tensor = self._list_to_long_tensor(encoder_input_tokens)
            encoder_input_positions_tensor = self._list_to_long_tensor(encoder_input_positions)
            cross_slot_mapping_tensor = self._list_to_long_tensor(cross_slot_mapping)
        else:
            encoder_input_tokens_tensor = self._empty_long_tensor()
            encoder_input_positions_tensor = self._empty_long_tensor()
            cross_slot_mapping_tensor = self._empty_long_tensor()

            cross_block_tables = []
            for seq_group_metadata in seq_group_metadata_list:
                if FIXED:
                    for _ in range(len(seq_group_metadata.seq_data)):
                        encoder_seq_lens.append(seq_group_metadata.encoder_seq_data.get_len())
                        cross_block_table = seq_group_metadata.cross_block_table
                        cross_block_tables.append([] if (cross_block_table is None) else cross_block_table)
                else:
                    encoder_seq_lens.append(seq_group_metadata.encoder_seq_data.get_len())
                    cross_block_table = seq_group_metadata.cross_block_table
                    cross_block_tables.append([] if (cross_block_table is None) else cross_block_table)

            if (model_input.attn_metadata is not None and model_input.attn_metadata.use_cuda_graph):
                max_len_of_block_table = self.get_max_block_per_batch()
                batch_size = len(encoder_seq_lens)
                graph_batch_size = _get_graph_batch_size(batch_size)
                assert graph_batch_size >= batch_size
                cuda_graph_pad_size = graph_batch_size - batch_size
                cross_block_tables.extend([[] for _ in range(cuda_graph_pad_size)])
                encoder_seq_lens.extend(itertools.repeat(1, cuda_graph_pad_size))
            else:
                max_len_of_block_table = max(len(block_table) for block_table in cross_block_tables)
            cross_block_tables = make_tensor_with_pad(
                cross_block_tables, max_len=max_len_of_block_table, pad=0,
                dtype=torch.int32, device=self.device)

        max_encoder_seq_len = max(encoder_seq_lens, default=0)
        encoder_seq_lens_tensor = self._list_to_int32_tensor(encoder_seq_lens)

        attn_metadata = model_input.attn_metadata
        (attn_metadata.num_encoder_tokens, attn_metadata.encoder_seq_lens,
         attn_metadata.encoder_seq_lens_tensor, attn_metadata.max_encoder_seq_len,
         attn_metadata.cross_slot_mapping, attn_metadata.cross_block_tables) = (
            sum(encoder_seq_lens), encoder_seq_lens, encoder_seq_lens_tensor,
            max_encoder_seq_len, cross_slot_mapping_tensor, cross_block_tables)
        return (attn_metadata, encoder_input_tokens_tensor, encoder_input_positions_tensor)


class BartCrossAttention(torch.nn.Module):
    """Decoder cross-attention over a paged encoder KV cache (attn_type=ENCODER_DECODER)."""

    def __init__(self, config: Config):
        super().__init__()
        self.num_heads = config.decoder_attention_heads
        self.head_dim = config.d_model // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = torch.nn.Linear(config.d_model, config.d_model)
        self.k_proj = torch.nn.Linear(config.d_model, config.d_model)
        self.v_proj = torch.nn.Linear(config.d_model, config.d_model)
        self.out_proj = torch.nn.Linear(config.d_model, config.d_model)

    @staticmethod
    def write_to_paged_cache(key, value, key_cache, value_cache, slot_mapping):
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot == PAD_SLOT_ID:
                continue
            key_cache[slot // key_cache.shape[1], slot % key_cache.shape[1]] = key[t].reshape(-1)
            value_cache[slot // value_cache.shape[1], slot % value_cache.shape[1]] = value[t].reshape(-1)

    def forward_decode(self, query, key_cache, value_cache, block_tables, seq_lens):
        # Reference for PagedAttention.forward_decode: row i reads seq_lens[i] slots of block_tables[i].
        block_size = key_cache.shape[1]
        out = torch.zeros_like(query)
        for i in range(query.shape[0]):
            n = int(seq_lens[i])
            blocks = block_tables[i].tolist()
            slots = [blocks[j // block_size] * block_size + j % block_size for j in range(n)]
            k = key_cache.view(-1, self.num_heads, self.head_dim)[slots].transpose(0, 1)
            v = value_cache.view(-1, self.num_heads, self.head_dim)[slots].transpose(0, 1)
            q = query[i].view(self.num_heads, 1, self.head_dim)
            o = F.scaled_dot_product_attention(q, k, v, scale=self.scaling)
            out[i] = o.reshape(-1)
        return out

    def forward(self, decoder_hidden_states, encoder_hidden_states, kv_cache, attn_metadata):
        key_cache, value_cache = kv_cache
        if encoder_hidden_states is not None:
            k = self.k_proj(encoder_hidden_states).view(-1, self.num_heads, self.head_dim)
            v = self.v_proj(encoder_hidden_states).view(-1, self.num_heads, self.head_dim)
            self.write_to_paged_cache(k, v, key_cache, value_cache, attn_metadata.cross_slot_mapping)
            return None
        q = self.q_proj(decoder_hidden_states)
        out = self.forward_decode(q, key_cache, value_cache, attn_metadata.cross_block_tables,
                                  attn_metadata.encoder_seq_lens_tensor)
        return self.out_proj(out)


class TinyBart(torch.nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.d_model)
        self.encoder_layer = torch.nn.Linear(config.d_model, config.d_model)
        self.encoder_attn = BartCrossAttention(config)
        self.lm_head = torch.nn.Linear(config.d_model, config.vocab_size, bias=False)

    def encode(self, encoder_input_ids, encoder_positions):
        h = self.embed_tokens(encoder_input_ids) + 0.1 * encoder_positions[:, None].float()
        return torch.tanh(self.encoder_layer(h))

    def decode_step(self, input_ids, kv_cache, attn_metadata):
        h = self.embed_tokens(input_ids)
        h = h + self.encoder_attn(h, None, kv_cache, attn_metadata)
        return self.lm_head(h)


def main():
    config = Config()
    model = TinyBart(config).eval()
    runner = EncoderDecoderModelRunner(config)
    key_cache = torch.randn(config.num_blocks, config.block_size, config.d_model)
    value_cache = torch.randn(config.num_blocks, config.block_size, config.d_model)
    kv_cache = (key_cache, value_cache)

    enc = {
        "req-0": SequenceData([5, 9, 12, 3, 7, 21]),          # beam search, 2 beams
        "req-1": SequenceData([14, 2, 30]),
        "req-2": SequenceData([8, 8, 19, 25, 11, 6, 4, 33, 17]),
    }
    cross_tables = {"req-0": [3, 7], "req-1": [1], "req-2": [9, 4, 12]}

    # Prefill: one decoder start token per group; cross K/V written through cross_slot_mapping.
    prefill = [
        SequenceGroupMetadata(rid, True, {10 * g: SequenceData([2])}, {10 * g: [g]},
                              enc[rid], cross_tables[rid])
        for g, rid in enumerate(enc)
    ]
    meta = AttentionMetadata(use_cuda_graph=False)
    model_input = EncoderDecoderModelInput(torch.tensor([2, 2, 2]), meta)
    meta, enc_tokens, enc_pos = runner._prepare_encoder_model_input_tensors(prefill, model_input)
    with torch.no_grad():
        enc_out = model.encode(enc_tokens, enc_pos)
        model.encoder_attn(None, enc_out, kv_cache, meta)

    # Decode: req-0 now holds two beams; the other requests one sequence each.
    decode = [
        SequenceGroupMetadata("req-0", False, {0: SequenceData([2, 17]), 1: SequenceData([2, 23])},
                              {0: [0], 1: [5]}, enc["req-0"], cross_tables["req-0"]),
        SequenceGroupMetadata("req-1", False, {10: SequenceData([2, 31])}, {10: [1]},
                              enc["req-1"], cross_tables["req-1"]),
        SequenceGroupMetadata("req-2", False, {20: SequenceData([2, 6])}, {20: [2]},
                              enc["req-2"], cross_tables["req-2"]),
    ]
    input_tokens = [sd.get_last_token_id() for g in decode for sd in g.seq_data.values()]
    num_seqs = len(input_tokens)
    graph_bs = _get_graph_batch_size(num_seqs)
    input_tokens += [0] * (graph_bs - num_seqs)  # decoder side pads its own rows for graph replay
    meta = AttentionMetadata(use_cuda_graph=True)
    model_input = EncoderDecoderModelInput(torch.tensor(input_tokens), meta)
    meta, _, _ = runner._prepare_encoder_model_input_tensors(decode, model_input)

    with torch.no_grad():
        logits = model.decode_step(model_input.input_tokens, kv_cache, meta)[:num_seqs]
    logprobs = torch.log_softmax(logits, dim=-1)
    top = logprobs.topk(2, dim=-1)
    print("encoder_seq_lens:", meta.encoder_seq_lens)
    print("cross_block_tables:", meta.cross_block_tables.tolist())
    rows = [(g.request_id, sid) for g in decode for sid in g.seq_data]
    for (rid, sid), ids, vals in zip(rows, top.indices.tolist(), top.values.tolist()):
        print(f"{rid} seq {sid}: next tokens {ids} logprobs {[round(v, 4) for v in vals]}")


if __name__ == "__main__":
    main()
