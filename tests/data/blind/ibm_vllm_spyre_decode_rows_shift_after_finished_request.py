"""IBM's vLLM fork for the Spyre (AIU) card: a request that finishes early shifts the others onto its row.

Citation: IBM/vllm#73 "bug fix: variable number of max decode tokens within batch" (merge commit 938fea3a3,
fix commit 3f087a717), vllm/worker/spyre_model_runner.py and vllm/model_executor/model_loader/spyre.py.

Spyre runs a static, warmed-up batch shape: ``_prepare_prompt`` left-pads every prompt to the warmup shape's
``prompt_length`` (``pad_input_ids``: a per-row padding mask turned into a 3D additive causal mask, position ids
0.. after the pads) and pads the batch with dummy rows up to the warmup ``batch_size``. The position ids, the
masks and the FMS model's KV cache keep that row order for the whole decode: ``_update_position_ids`` /
``_update_mask`` extend each row by one slot per step.

The bug: ``_prepare_decode`` appended the last token of each *still running* request one after another and
then filled up to the batch size with token 0. Once a request in the middle of the batch finished (its
``max_tokens`` was smaller), every later request's token landed on the row before its own, and was decoded
with another request's position ids, padding mask and KV cache; ``logits[:batch_size - num_padded_sequences]``
then handed those rows to the sampler.

The fix: ``_req_ids2idx`` maps each request id to its prompt row, ``_prepare_decode`` writes the token to that
row (the others get token 0), and ``SpyreCausalLM.indices`` (rows of finished requests set False from
``finished_requests_ids``) selects the logits.

The FMS LLaMA that vLLM loads (``fms.models.get_model``) is written here at toy size with random weights, as
FMS writes it: rotary embeddings read at ``position_ids``, the KV cache concatenated along the sequence, the
mask (B, Lq, Lk) unsqueezed over heads and given to ``F.scaled_dot_product_attention`` as ``attn_mask``.
"""

import dataclasses
import math
import sys
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# --------------------------------------------------------------------------------------------------------------
# fms.models.llama (trimmed): LLaMA, LLaMABlock, MultiHeadAttention, RotaryEmbedding
# --------------------------------------------------------------------------------------------------------------


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, ratio=10000.0, max_seq_len=2048):
        super().__init__()
        freqs = 1.0 / (ratio ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_seq_len).float()
        freqs = torch.outer(t, freqs)
        self.register_buffer("cached_freqs", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def adjusted_qk(self, q, k, position_ids):
        # q, k: (B, L, H, D); position_ids: (B, L)
        freqs = self.cached_freqs[position_ids].unsqueeze(2)  # (B, L, 1, D/2)
        q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        k_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
        q_out = torch.view_as_real(q_ * freqs).flatten(3)
        k_out = torch.view_as_real(k_ * freqs).flatten(3)
        return q_out.type_as(q), k_out.type_as(k)


class LayerNormParameterized(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight


class MultiHeadAttention(nn.Module):
    def __init__(self, emb_dim, nheads, position_encoder):
        super().__init__()
        self.nheads = nheads
        self.emb_kq_per_head = emb_dim // nheads
        self.query = nn.Linear(emb_dim, emb_dim, bias=False)
        self.key = nn.Linear(emb_dim, emb_dim, bias=False)
        self.value = nn.Linear(emb_dim, emb_dim, bias=False)
        self.dense = nn.Linear(emb_dim, emb_dim, bias=False)
        self.position_encoder = position_encoder

    def forward(self, q, mask=None, position_ids=None, attn_algorithm=None, past_key_value_state=None,
                use_cache=False, is_self=True, is_causal_mask=False):
        batch_size, q_len, _ = q.shape
        queries = self.query(q).view(batch_size, q_len, self.nheads, self.emb_kq_per_head)
        keys = self.key(q).view(batch_size, q_len, self.nheads, self.emb_kq_per_head)
        values = self.value(q).view(batch_size, q_len, self.nheads, self.emb_kq_per_head)

        if self.position_encoder is not None:
            queries, keys = self.position_encoder.adjusted_qk(queries, keys, position_ids)

        queries = queries.transpose(2, 1)
        keys = keys.transpose(2, 1)
        values = values.transpose(2, 1)

        if use_cache and past_key_value_state is not None and past_key_value_state[0].numel() > 0:
            keys = torch.cat((past_key_value_state[0], keys), dim=2)
            values = torch.cat((past_key_value_state[1], values), dim=2)

        attn_mask = mask
        if attn_mask is not None:
            while len(attn_mask.size()) != 4:
                attn_mask = attn_mask.unsqueeze(1)
            if attn_mask.dtype != torch.bool:
                attn_mask = attn_mask.to(dtype=queries.dtype)

        attn = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attn_mask, dropout_p=0.0,
            is_causal=is_causal_mask and mask is None,
        )
        attn = attn.transpose(2, 1).contiguous().view(batch_size, q_len, -1)
        out = self.dense(attn)
        if use_cache:
            return out, (keys, values)
        return out


class LLaMABlock(nn.Module):
    def __init__(self, config, rotary_emb):
        super().__init__()
        self.ln = LayerNormParameterized(config.hidden_size, eps=config.rms_norm_eps)
        self.ff_ln = LayerNormParameterized(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = MultiHeadAttention(config.hidden_size, config.num_attention_heads, rotary_emb)
        self.wg = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x, *, mask=None, position_ids=None, past_key_value_state=None, use_cache=False,
                is_causal_mask=False, attn_algorithm=None):
        self_attn_past_key_value = past_key_value_state
        residual = x
        x = self.ln(x)
        x = self.attn(q=x, mask=mask, position_ids=position_ids, attn_algorithm=attn_algorithm,
                      past_key_value_state=self_attn_past_key_value, use_cache=use_cache,
                      is_self=True, is_causal_mask=is_causal_mask)
        cache = None
        if use_cache:
            x, cache = x
        x = x + residual
        residual = x
        x = self.ff_ln(x)
        x = self.w2(F.silu(self.wg(x)) * self.w1(x))
        x = x + residual
        if use_cache:
            return x, cache
        return x


class LLaMA(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rot_emb = RotaryEmbedding(config.hidden_size // config.num_attention_heads,
                                       ratio=10000.0,
                                       max_seq_len=config.max_position_embeddings)
        self.layers = nn.ModuleList([LLaMABlock(config, self.rot_emb) for _ in range(config.num_hidden_layers)])
        self.dec_norm = LayerNormParameterized(config.hidden_size, eps=config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _helper(self, x_in, mask=None, position_ids=None, past_key_value_states=None, use_cache=False,
                attn_algorithm=None):
        qlen = x_in.size(1)
        klen = x_in.size(1)
        if past_key_value_states is None or len(past_key_value_states) == 0:
            past_key_value_states = [None for _ in range(len(self.layers))]
        if past_key_value_states[0] is not None:
            klen += past_key_value_states[0][0].size(-2)
        is_causal_mask = mask is None and qlen == klen and qlen > 1

        x_in = self.shared(x_in)
        present_key_value_states = []
        for i, layer in enumerate(self.layers):
            output = layer(x=x_in, mask=mask, position_ids=position_ids,
                           past_key_value_state=past_key_value_states[i], use_cache=use_cache,
                           is_causal_mask=is_causal_mask, attn_algorithm=attn_algorithm)
            if use_cache:
                x_in, present_key_value_state = output
                present_key_value_states.append(present_key_value_state)
            else:
                x_in = output
        dec_out = self.dec_norm(x_in)
        return dec_out, present_key_value_states

    def forward(self, x, mask=None, position_ids=None, past_key_value_states=None, use_cache=False,
                only_last_token=False, attn_algorithm=None):
        output, cache = self._helper(x, mask, position_ids, past_key_value_states, use_cache, attn_algorithm)
        if only_last_token:
            output = output[:, -1, :]
        preds = self.head(output)
        if use_cache:
            return preds, cache
        return preds


# --------------------------------------------------------------------------------------------------------------
# vllm/model_executor/model_loader/spyre.py: SpyreCausalLM
# --------------------------------------------------------------------------------------------------------------


class SpyreCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.past_key_value_states = None
        self.dtype = torch.float32
        if FIXED:
            # indices: True unfinished, False for finished or padded sequence
            self.indices = None
        else:
            # number of added padding sequences to fill
            # batch to warmed up batch size
            self.num_padded_sequences = 0
        self.model = LLaMA(config).eval()

    def forward(self, input_ids, positions, masks, is_prompt):
        if is_prompt:
            self.past_key_value_states = None

        extra_kwargs = {"attn_algorithm": "math"}
        output = self.model(
            input_ids,
            position_ids=positions,
            mask=masks,
            past_key_value_states=self.past_key_value_states,
            use_cache=True,
            only_last_token=True,
            **extra_kwargs,
        )
        logits, past_key_value_states = output
        self.past_key_value_states = past_key_value_states

        if FIXED:
            # removing finished or padded sequences
            logits = logits[self.indices]
        else:
            # removing batch padding sequences to compute logits
            batch_size = input_ids.shape[0]
            logits = logits[:batch_size - self.num_padded_sequences]
        return logits

    def sample(self, logits):
        # greedy sampling (vLLM's Sampler with temperature 0)
        return logits.argmax(dim=-1).tolist()


# --------------------------------------------------------------------------------------------------------------
# vllm/sequence.py (what the runner reads of it)
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int


@dataclasses.dataclass
class SequenceData:
    prompt_token_ids: List[int]
    output_token_ids: List[int] = dataclasses.field(default_factory=list)

    def get_token_ids(self):
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self):
        return self.get_token_ids()[-1]


@dataclasses.dataclass
class SequenceGroupMetadata:
    request_id: str
    is_prompt: bool
    seq_data: Dict[int, SequenceData]
    sampling_params: SamplingParams


# --------------------------------------------------------------------------------------------------------------
# vllm/worker/spyre_model_runner.py: SpyreModelRunner
# --------------------------------------------------------------------------------------------------------------


class SpyreModelRunner:
    def __init__(self, hf_config: LlamaConfig, spyre_warmup_shapes):
        self.spyre_warmup_shapes = spyre_warmup_shapes
        self.pad_token_id = getattr(hf_config, "pad_token_id", None) or 0
        # position_ids of all the sequences in current batch
        self._position_ids: torch.Tensor = None
        # attention masks of all the sequences in current batch
        self._mask: torch.Tensor = None
        if FIXED:
            # mapping: request id to index in batch
            self._req_ids2idx: dict = {}
        self.model = SpyreCausalLM(hf_config)

    def _prepare_prompt(self, seq_group_metadata_list: List[SequenceGroupMetadata]):
        assert len(seq_group_metadata_list) > 0
        input_token_list: List[torch.Tensor] = []

        # find warmup shape to be used for padding and batching
        applicable_spyre_warmup_shapes = [
            shape for shape in self.spyre_warmup_shapes
            if len(seq_group_metadata_list) <= shape["batch_size"]
        ]
        for seq_group_metadata in seq_group_metadata_list:
            seq_data = seq_group_metadata.seq_data[list(seq_group_metadata.seq_data.keys())[0]]
            prompt_tokens = seq_data.get_token_ids()
            new_tokens = seq_group_metadata.sampling_params.max_tokens
            applicable_spyre_warmup_shapes = [
                shape for shape in applicable_spyre_warmup_shapes
                if len(prompt_tokens) <= shape["prompt_length"] and new_tokens <= shape["new_tokens"]
            ]
        assert applicable_spyre_warmup_shapes

        min_pad_length_batch = applicable_spyre_warmup_shapes[0]["prompt_length"]
        padded_batch_size = applicable_spyre_warmup_shapes[0]["batch_size"]

        if FIXED:
            self._req_ids2idx = {}
        for idx, seq_group_metadata in enumerate(seq_group_metadata_list):
            assert seq_group_metadata.is_prompt
            if FIXED:
                self._req_ids2idx[seq_group_metadata.request_id] = idx
            seq_ids = list(seq_group_metadata.seq_data.keys())
            assert len(seq_ids) == 1
            seq_data = seq_group_metadata.seq_data[seq_ids[0]]
            prompt_tokens = seq_data.get_token_ids()
            input_token_list.append(torch.tensor(prompt_tokens, dtype=torch.long))

        if FIXED:
            actual_batch_size = len(input_token_list)
            self.model.indices = torch.cat([
                torch.ones(actual_batch_size, dtype=torch.bool),
                torch.zeros(padded_batch_size - actual_batch_size, dtype=torch.bool),
            ])
        else:
            # set number of added padding sequences used for computing logits
            self.model.num_padded_sequences = padded_batch_size - len(input_token_list)

        # padding to compiled batch size
        while len(input_token_list) < padded_batch_size:
            input_token_list.append(torch.zeros(min_pad_length_batch, dtype=torch.long))

        # get position ids and attention mask
        input_tokens, self._position_ids, self._mask = self.pad_input_ids(
            input_token_list, min_pad_length=min_pad_length_batch)
        seq_lens = [t.shape[0] for t in input_token_list]
        return input_tokens, self._position_ids, self._mask, seq_lens

    def _prepare_decode(self, seq_group_metadata_list: List[SequenceGroupMetadata]):
        assert len(seq_group_metadata_list) > 0
        if FIXED:
            input_tokens: List[List[int]] = [[0] for _ in range(self._position_ids.shape[0])]
        else:
            input_tokens: List[List[int]] = []

        for seq_group_metadata in seq_group_metadata_list:
            assert not seq_group_metadata.is_prompt
            seq_ids = list(seq_group_metadata.seq_data.keys())
            assert len(seq_ids) == 1
            seq_data = seq_group_metadata.seq_data[seq_ids[0]]
            generation_token = seq_data.get_last_token_id()
            if FIXED:
                input_tokens[self._req_ids2idx[seq_group_metadata.request_id]] = [generation_token]
            else:
                input_tokens.append([generation_token])

        if not FIXED:
            #  padding to compiled batch size
            actual_batch_size = len(seq_group_metadata_list)
            padded_batch_size = self._position_ids.shape[0]

            # set number of added padding sequences used for computing logits
            self.model.num_padded_sequences = padded_batch_size - actual_batch_size

            while actual_batch_size < padded_batch_size:
                input_tokens.append([0])
                actual_batch_size += 1

        # update position ids and attention mask
        self._update_position_ids()
        self._update_mask()

        input_tokens = torch.tensor(input_tokens, dtype=torch.long)
        return input_tokens, self._position_ids, self._mask

    def _update_position_ids(self) -> None:
        """Updating the position ids of all sequences
        in a batch. Will be called in decoding phase"""
        self._position_ids = self._position_ids[:, -1] + 1
        self._position_ids = self._position_ids.unsqueeze(-1)

    def _update_mask(self) -> None:
        """Updating/extending the attention masks of all
        sequences in a batch. Will be called in decoding phase"""
        assert self._mask is not None
        masks = self._mask
        masks_new = []
        for mask in masks:
            # get the last row of the 3d mask
            mask_new = mask[-1:, :]
            # extend the mask one slot
            mask_new = torch.cat(
                (mask_new, torch.zeros(1, 1, dtype=mask_new.dtype, device=mask_new.device)),
                dim=1,
            )
            masks_new.append(mask_new)
        self._mask = torch.stack(masks_new, dim=0)

    def prepare_model_input(self, seq_group_metadata_list, finished_requests_ids=None):
        # NOTE: We assume that all sequences in the group are all prompts or
        # all decodes.
        is_prompt = seq_group_metadata_list[0].is_prompt
        if is_prompt:
            (input_tokens, input_positions, input_masks, _) = self._prepare_prompt(seq_group_metadata_list)
        else:
            if FIXED:
                # updating indices: set indices of newly finished sequences False
                if finished_requests_ids:
                    for seq_id in finished_requests_ids:
                        self.model.indices[self._req_ids2idx[seq_id]] = False
            (input_tokens, input_positions, input_masks) = self._prepare_decode(seq_group_metadata_list)
        return input_tokens, input_positions, input_masks, is_prompt

    @torch.no_grad()
    def execute_model(self, seq_group_metadata_list, finished_requests_ids=None):
        input_tokens, input_positions, input_masks, is_prompt = self.prepare_model_input(
            seq_group_metadata_list, finished_requests_ids)
        logits = self.model(input_ids=input_tokens, positions=input_positions, masks=input_masks,
                            is_prompt=is_prompt)
        return self.model.sample(logits)

    def _prepare_pad_input_ids(self, input_ids_list: List[torch.Tensor], min_pad_length: int = 0):
        """left side padding implemented as
        in fms.utils.generation.pad_input_id"""
        max_len = max([min_pad_length] + [seq.size(0) for seq in input_ids_list])
        padded_input_ids_list = []
        mask_list = []
        position_ids_list = []
        for input_ids_i in input_ids_list:
            seq_len = input_ids_i.size(0)
            pads = torch.ones(max_len - seq_len, dtype=torch.long, device=input_ids_i.device) * self.pad_token_id
            non_pads = torch.ones(seq_len, dtype=torch.long, device=input_ids_i.device)
            pos_ids_pads = pads
            pos_ids_seq = torch.arange(0, seq_len, dtype=torch.long, device=input_ids_i.device)
            padded_input_ids_list.append(torch.cat((pads, input_ids_i)))
            mask_list.append(torch.cat((torch.zeros_like(pads), non_pads)))
            position_ids_list.append(torch.cat((pos_ids_pads, pos_ids_seq)))
        return padded_input_ids_list, mask_list, position_ids_list

    def pad_input_ids(self, input_ids_list: List[torch.Tensor], min_pad_length: int = 0):
        padded_input_ids_list, mask_list, position_ids_list = self._prepare_pad_input_ids(
            input_ids_list, min_pad_length)
        input_ids = torch.stack(padded_input_ids_list)
        mask = torch.stack(mask_list).bool()
        # this is a causal mask for generation
        mask = (mask.unsqueeze(-1) == mask.unsqueeze(-2)).tril()
        mask = torch.where(mask.logical_not(), -torch.inf, 0.0)
        mask = mask.to(self.model.dtype)
        position_ids = torch.stack(position_ids_list)
        return input_ids, position_ids, mask


# --------------------------------------------------------------------------------------------------------------
# A static-batch engine loop (vLLM's LLMEngine with the Spyre scheduler, trimmed): one prefill of the whole
# batch, then decode steps over the requests still running; a request leaves after max_tokens tokens.
# --------------------------------------------------------------------------------------------------------------


def main():
    hf_config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6,
                            pad_token_id=0)
    spyre_warmup_shapes = [{"prompt_length": 8, "new_tokens": 6, "batch_size": 4}]
    runner = SpyreModelRunner(hf_config, spyre_warmup_shapes)

    prompts = {
        "req-0": [5, 17, 9, 33, 2, 41, 12],
        "req-1": [8, 23, 4],       # asks for fewer tokens: finishes first
        "req-2": [30, 7, 19, 11, 25],
    }
    max_tokens = {"req-0": 6, "req-1": 2, "req-2": 6}
    groups = [
        SequenceGroupMetadata(request_id=rid, is_prompt=True, seq_data={i: SequenceData(list(toks))},
                              sampling_params=SamplingParams(max_tokens=max_tokens[rid]))
        for i, (rid, toks) in enumerate(prompts.items())
    ]

    running = list(groups)
    finished_requests_ids: List[str] = []
    while running:
        next_tokens = runner.execute_model(running, finished_requests_ids)
        finished_requests_ids = []
        still_running = []
        for group, token in zip(running, next_tokens):
            seq_data = next(iter(group.seq_data.values()))
            seq_data.output_token_ids.append(token)
            group.is_prompt = False
            if len(seq_data.output_token_ids) >= group.sampling_params.max_tokens:
                finished_requests_ids.append(group.request_id)
            else:
                still_running.append(group)
        running = still_running

    for group in groups:
        seq_data = next(iter(group.seq_data.values()))
        print(group.request_id, "prompt", seq_data.prompt_token_ids, "->", seq_data.output_token_ids)


if __name__ == "__main__":
    main()
