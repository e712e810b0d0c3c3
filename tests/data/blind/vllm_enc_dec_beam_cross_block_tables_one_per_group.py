# Citation: vllm-project/vllm#8545 ("[Bugfix] [Encoder-Decoder] Bugfix for encoder specific metadata
# construction during decode of encoder-decoder models").
#
# vllm/worker/enc_dec_model_runner.py, EncoderDecoderModelRunner._prepare_encoder_model_input_tensors:
# in the decode phase the cross-attention block tables and encoder_seq_lens were built with one entry
# per *sequence group*, while the decode batch has one query row per *sequence*. With beam search a
# group holds several sequences, so the rows of the paged cross-attention (block table + encoder length
# per row) no longer line up with the queries: a beam reads another request's encoder KV, and the last
# rows read the CUDA-graph padding entry. The fix appends the group's cross block table and encoder
# length once for each sequence in the group (`for _ in range(len(seq_group_metadata.seq_data))`).
#
# Ported trimmed: SequenceData / SequenceGroupMetadata, the encoder-side metadata builder (prefill and
# decode, with the CUDA-graph padding path), make_tensor_with_pad, _get_graph_batch_size, the cross KV
# cache write by slot mapping, and the paged decode attention written as vLLM's reference kernel
# (tests/kernels: ref_single_query_cached_kv_attention). `python FILE --fixed` runs the fixed builder.
import itertools
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

FIXED = "--fixed" in sys.argv

_PAD_SLOT_ID = -1
_BATCH_SIZE_ALIGNMENT = 8


def _get_graph_batch_size(batch_size: int) -> int:
    if batch_size <= 2:
        return batch_size
    elif batch_size <= 4:
        return 4
    else:
        return ((batch_size + _BATCH_SIZE_ALIGNMENT - 1) // _BATCH_SIZE_ALIGNMENT *
                _BATCH_SIZE_ALIGNMENT)


def make_tensor_with_pad(x, pad, dtype, *, max_len=None, device=None):
    if max_len is None:
        max_len = max(map(len, x), default=0)
    padded = [list(row) + [pad] * (max_len - len(row)) for row in x]
    return torch.tensor(padded, dtype=dtype, device=device)


class SequenceData:

    def __init__(self, prompt_token_ids: List[int], output_token_ids: Optional[List[int]] = None):
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids = list(output_token_ids or [])

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_token_ids(self) -> List[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        return self.get_token_ids()[-1]


@dataclass
class SequenceGroupMetadata:
    request_id: str
    is_prompt: bool
    seq_data: Dict[int, SequenceData]
    block_tables: Optional[Dict[int, List[int]]]
    encoder_seq_data: Optional[SequenceData] = None
    cross_block_table: Optional[List[int]] = None


@dataclass
class AttentionMetadata:
    use_cuda_graph: bool = False
    num_encoder_tokens: int = 0
    encoder_seq_lens: Optional[List[int]] = None
    encoder_seq_lens_tensor: Optional[torch.Tensor] = None
    max_encoder_seq_len: int = 0
    encoder_seq_start_loc: Optional[torch.Tensor] = None
    cross_slot_mapping: Optional[torch.Tensor] = None
    cross_block_tables: Optional[torch.Tensor] = None


@dataclass
class EncoderDecoderModelInput:
    attn_metadata: AttentionMetadata


class EncoderDecoderModelRunner:

    def __init__(self, block_size: int, max_seq_len_to_capture: int):
        self.block_size = block_size
        self.max_seq_len_to_capture = max_seq_len_to_capture
        self.device = "cpu"

    def get_max_block_per_batch(self) -> int:
        return (self.max_seq_len_to_capture + self.block_size - 1) // self.block_size

    def _list_to_int32_tensor(self, _list):
        return torch.tensor(_list, dtype=torch.int32, device=self.device)

    def _list_to_long_tensor(self, _list):
        return torch.tensor(_list, dtype=torch.long, device=self.device)

    def _empty_int32_tensor(self):
        return self._list_to_int32_tensor([])

    def _empty_long_tensor(self):
        return self._list_to_long_tensor([])

    def _prepare_encoder_model_input_tensors(self, seq_group_metadata_list, model_input):
        if len(seq_group_metadata_list) == 0:
            return (model_input.attn_metadata, None, None)

        # Since we are not supporting chunked prefill either the entire
        # batch is prefill or it is decode
        is_prompt = seq_group_metadata_list[0].is_prompt

        # Build encoder inputs
        encoder_seq_lens: List[int] = []
        if is_prompt:
            # Prefill phase.
            cross_block_tables = self._empty_int32_tensor().view(len(seq_group_metadata_list), -1)

            encoder_input_tokens, encoder_input_positions, cross_slot_mapping = [], [], []
            for seq_group_metadata in seq_group_metadata_list:
                # Build seq lens
                seq_len = seq_group_metadata.encoder_seq_data.get_len()
                token_ids = seq_group_metadata.encoder_seq_data.get_token_ids()
                encoder_seq_lens.append(seq_len)

                # Build slot mapping
                is_profile_run = (seq_group_metadata.block_tables is None)
                if is_profile_run:
                    cross_slot_mapping.extend([_PAD_SLOT_ID] * seq_len)
                else:
                    for i in range(0, seq_len):
                        block_number = seq_group_metadata.cross_block_table[i // self.block_size]
                        block_offset = i % self.block_size
                        slot = block_number * self.block_size + block_offset
                        cross_slot_mapping.append(slot)

                # Build encoder input tokens
                encoder_input_tokens.extend(token_ids)
                encoder_input_positions.extend(list(range(0, seq_len)))

            encoder_input_tokens_tensor = self._list_to_long_tensor(encoder_input_tokens)
            encoder_input_positions_tensor = self._list_to_long_tensor(encoder_input_positions)
            cross_slot_mapping_tensor = self._list_to_long_tensor(cross_slot_mapping)

        else:
            # Decode phase.
            encoder_input_tokens_tensor = self._empty_long_tensor()
            encoder_input_positions_tensor = self._empty_long_tensor()
            cross_slot_mapping_tensor = self._empty_long_tensor()
            # Extract cross-attention block tables &
            # seq len from each sequence group metadata.
            # Cross-attention block tables are empty
            # during vLLM memory profiling.
            cross_block_tables = []
            for seq_group_metadata in seq_group_metadata_list:
                if FIXED:
                    for _ in range(len(seq_group_metadata.seq_data)):
                        encoder_seq_lens.append(seq_group_metadata.encoder_seq_data.get_len())
                        cross_block_table = seq_group_metadata.cross_block_table
                        cross_block_tables.append([] if (
                            cross_block_table is None) else cross_block_table)
                else:
                    encoder_seq_lens.append(seq_group_metadata.encoder_seq_data.get_len())
                    cross_block_table = seq_group_metadata.cross_block_table
                    cross_block_tables.append([] if (
                        cross_block_table is None) else cross_block_table)

            if (model_input.attn_metadata is not None
                    and model_input.attn_metadata.use_cuda_graph):
                # We will be using CUDA graph replay for this decode.
                max_len_of_block_table = self.get_max_block_per_batch()
                batch_size = len(encoder_seq_lens)
                graph_batch_size = _get_graph_batch_size(batch_size)
                assert graph_batch_size >= batch_size
                cuda_graph_pad_size = graph_batch_size - batch_size
                # extend the cross_block_tables and encoder_seq_lens to match
                # the graph_batch_size.
                cross_block_tables.extend([[] for _ in range(cuda_graph_pad_size)])
                encoder_seq_lens.extend(itertools.repeat(1, cuda_graph_pad_size))
            else:
                max_len_of_block_table = max(len(block_table) for block_table in cross_block_tables)

            cross_block_tables = make_tensor_with_pad(
                cross_block_tables,
                max_len=max_len_of_block_table,
                pad=0,
                dtype=torch.int32,
                device=self.device,
            )

        # Compute encoder sequence lengths & encoder
        # sequence starting offset tensors
        max_encoder_seq_len = max(encoder_seq_lens, default=0)
        encoder_seq_lens_tensor = self._list_to_int32_tensor(encoder_seq_lens)
        encoder_seq_start_loc = torch.zeros(encoder_seq_lens_tensor.shape[0] + 1,
                                            dtype=torch.int32, device=self.device)
        torch.cumsum(encoder_seq_lens_tensor, dim=0, dtype=encoder_seq_start_loc.dtype,
                     out=encoder_seq_start_loc[1:])

        attn_metadata = model_input.attn_metadata
        (
            attn_metadata.num_encoder_tokens,
            attn_metadata.encoder_seq_lens,
            attn_metadata.encoder_seq_lens_tensor,
            attn_metadata.max_encoder_seq_len,
            attn_metadata.encoder_seq_start_loc,
            attn_metadata.cross_slot_mapping,
            attn_metadata.cross_block_tables,
        ) = (
            sum(encoder_seq_lens),
            encoder_seq_lens,
            encoder_seq_lens_tensor,
            max_encoder_seq_len,
            encoder_seq_start_loc,
            cross_slot_mapping_tensor,
            cross_block_tables,
        )
        return (attn_metadata, encoder_input_tokens_tensor, encoder_input_positions_tensor)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    # key/value: [num_tokens, num_heads, head_size]; cache: [num_blocks, block_size, num_heads, head_size]
    block_size = key_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[i]
        value_cache[slot // block_size, slot % block_size] = value[i]


def paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    # As vLLM's ref_single_query_cached_kv_attention: one query row per sequence, keys gathered
    # through that row's block table up to that row's length.
    output = torch.empty_like(query)
    block_size = key_cache.shape[1]
    block_tables_lst = block_tables.tolist()
    seq_lens_lst = seq_lens.tolist()
    num_seqs = query.shape[0]
    for i in range(num_seqs):
        q = query[i].unsqueeze(0)
        block_table = block_tables_lst[i]
        seq_len = int(seq_lens_lst[i])
        keys_lst, values_lst = [], []
        for j in range(seq_len):
            block_number = int(block_table[j // block_size])
            block_offset = j % block_size
            keys_lst.append(key_cache[block_number, block_offset])
            values_lst.append(value_cache[block_number, block_offset])
        keys = torch.stack(keys_lst, dim=0)
        values = torch.stack(values_lst, dim=0)
        attn_weights = scale * torch.einsum("qhd,khd->hqk", q, keys).float()
        attn_weights = torch.softmax(attn_weights, dim=-1).to(values.dtype)
        out = torch.einsum("hqk,khd->qhd", attn_weights, values)
        output[i].copy_(out[0])
    return output


class TinyCrossAttnDecoder(torch.nn.Module):
    """One decoder cross-attention layer over the paged cross KV cache (BART-style q/k/v/out)."""

    def __init__(self, vocab_size=32, hidden=16, num_heads=2):
        super().__init__()
        self.num_heads, self.head_size = num_heads, hidden // num_heads
        self.embed_tokens = torch.nn.Embedding(vocab_size, hidden)
        self.encoder = torch.nn.Linear(hidden, hidden)
        self.q_proj = torch.nn.Linear(hidden, hidden)
        self.k_proj = torch.nn.Linear(hidden, hidden)
        self.v_proj = torch.nn.Linear(hidden, hidden)
        self.out_proj = torch.nn.Linear(hidden, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab_size, bias=False)

    def encode_and_cache(self, encoder_input_ids, key_cache, value_cache, attn_metadata):
        enc = torch.tanh(self.encoder(self.embed_tokens(encoder_input_ids)))
        k = self.k_proj(enc).view(-1, self.num_heads, self.head_size)
        v = self.v_proj(enc).view(-1, self.num_heads, self.head_size)
        reshape_and_cache(k, v, key_cache, value_cache, attn_metadata.cross_slot_mapping)

    def decode(self, input_ids, key_cache, value_cache, attn_metadata):
        h = self.embed_tokens(input_ids)
        q = self.q_proj(h).view(-1, self.num_heads, self.head_size)
        attn = paged_attention_decode(q, key_cache, value_cache,
                                      attn_metadata.cross_block_tables,
                                      attn_metadata.encoder_seq_lens_tensor,
                                      self.head_size ** -0.5)
        h = h + self.out_proj(attn.reshape(-1, self.num_heads * self.head_size))
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    block_size = 4
    runner = EncoderDecoderModelRunner(block_size=block_size, max_seq_len_to_capture=16)
    model = TinyCrossAttnDecoder().eval()
    num_blocks = 12
    key_cache = torch.zeros(num_blocks, block_size, model.num_heads, model.head_size)
    value_cache = torch.zeros_like(key_cache)

    # Three requests with encoder prompts of different lengths; the block manager gave each
    # its own cross-attention blocks.
    encoder_prompts = [[3, 7, 9, 11, 4, 6], [12, 5, 8], [20, 21, 22, 23, 24, 25, 26]]
    cross_tables = [[1, 2], [4], [6, 7]]

    prefill = []
    for g, (enc, tbl) in enumerate(zip(encoder_prompts, cross_tables)):
        prefill.append(SequenceGroupMetadata(
            request_id=str(g), is_prompt=True, seq_data={10 * g: SequenceData([1])},
            block_tables={10 * g: [g]}, encoder_seq_data=SequenceData(enc),
            cross_block_table=tbl))
    model_input = EncoderDecoderModelInput(AttentionMetadata())
    attn_metadata, enc_tokens, _ = runner._prepare_encoder_model_input_tensors(prefill, model_input)
    with torch.no_grad():
        model.encode_and_cache(enc_tokens, key_cache, value_cache, attn_metadata)

    # Decode step: request 0 runs beam search with two beams, requests 1 and 2 one sequence each.
    decode = [
        SequenceGroupMetadata(request_id="0", is_prompt=False,
                              seq_data={0: SequenceData([1], [5]), 1: SequenceData([1], [9])},
                              block_tables={0: [0], 1: [3]},
                              encoder_seq_data=SequenceData(encoder_prompts[0]),
                              cross_block_table=cross_tables[0]),
        SequenceGroupMetadata(request_id="1", is_prompt=False,
                              seq_data={10: SequenceData([1], [14])}, block_tables={10: [1]},
                              encoder_seq_data=SequenceData(encoder_prompts[1]),
                              cross_block_table=cross_tables[1]),
        SequenceGroupMetadata(request_id="2", is_prompt=False,
                              seq_data={20: SequenceData([1], [2])}, block_tables={20: [2]},
                              encoder_seq_data=SequenceData(encoder_prompts[2]),
                              cross_block_table=cross_tables[2]),
    ]
    input_ids = torch.tensor([sd.get_last_token_id() for sg in decode for sd in sg.seq_data.values()])
    model_input = EncoderDecoderModelInput(AttentionMetadata(use_cuda_graph=True))
    attn_metadata, _, _ = runner._prepare_encoder_model_input_tensors(decode, model_input)
    with torch.no_grad():
        logits = model.decode(input_ids, key_cache, value_cache, attn_metadata)
    logprobs = torch.log_softmax(logits, dim=-1)
    next_tokens = logprobs.argmax(dim=-1)
    print("encoder_seq_lens:", attn_metadata.encoder_seq_lens)
    print("next tokens per sequence:", next_tokens.tolist())
    print("top logprob per sequence:", [round(v, 4) for v in logprobs.max(dim=-1).values.tolist()])


if __name__ == "__main__":
    main()
