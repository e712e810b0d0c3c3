# bigscience-workshop/Megatron-DeepSpeed commit 5207386 ("Fix prefixlm"): pretrain_ul2.py built the non-causal
# (prefix-LM) UL2 decoder with pretrain_causal_attention=True and AttnMaskType.causal, so the dataset's dec_mask was dropped.
import enum
import math
import sys
import types

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    custom = 4


class UL2ModelType(enum.Enum):
    ENCODER_DECODER = "ED"
    NON_CAUSAL_DECODER = "ND"
    CAUSAL_DECODER = "CD"


_ARGS = types.SimpleNamespace(hidden_size=32, num_attention_heads=4, num_layers=2, padded_vocab_size=64,
                              seq_length=16, ul2_model_type=UL2ModelType.NON_CAUSAL_DECODER)


def get_args():
    return _ARGS


def is_decoder_only():
    return get_args().ul2_model_type is not UL2ModelType.ENCODER_DECODER


def is_prefix_lm():
    return get_args().ul2_model_type is UL2ModelType.NON_CAUSAL_DECODER


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, torch.finfo(attention_scores.dtype).min)
    return attention_scores


class FusedScaleMaskSoftmax(nn.Module):
    """Torch fallback path of megatron/model/fused_softmax.py (no CUDA kernel on CPU)."""

    def __init__(self, attn_mask_type, mask_func, scale=None):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.mask_func = mask_func
        self.scale = scale

    @staticmethod
    def get_causal_mask(sequence_length):
        mask = torch.ones(1, 1, sequence_length, sequence_length, dtype=torch.bool)
        return torch.triu(mask, diagonal=1)

    def forward(self, input, mask):
        if self.scale is not None:
            input = input * self.scale
        if self.attn_mask_type == AttnMaskType.causal and mask is None:
            mask = self.get_causal_mask(input.shape[2])
        mask_output = self.mask_func(input, mask) if mask is not None else input
        return torch.nn.Softmax(dim=-1)(mask_output)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, layer_number, self_attn_mask_type=AttnMaskType.padding):
        super().__init__()
        args = get_args()
        h = args.hidden_size
        self.np = args.num_attention_heads
        self.hn = h // self.np
        self.input_layernorm = nn.LayerNorm(h)
        self.query_key_value = nn.Linear(h, 3 * h)
        self.dense = nn.Linear(h, h)
        self.post_attention_layernorm = nn.LayerNorm(h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
        self.norm_factor = math.sqrt(self.hn)
        self.scale_mask_softmax = FusedScaleMaskSoftmax(self_attn_mask_type, attention_mask_func)

    def forward(self, hidden_states, attention_mask):
        # hidden_states: [s, b, h]
        s, b, _ = hidden_states.shape
        x = self.input_layernorm(hidden_states)
        q, k, v = self.query_key_value(x).view(s, b, self.np, 3 * self.hn).chunk(3, dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, hn]
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.norm_factor
        probs = self.scale_mask_softmax(scores, attention_mask)
        ctx = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, -1)
        hidden_states = hidden_states + self.dense(ctx)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    def forward(self, inputs, **kwargs):
        if torch.is_tensor(inputs) or len(inputs) == 1:
            hidden_states, attention_mask = inputs, None
            return super().forward(hidden_states, attention_mask, **kwargs)
        hidden_states, attention_mask = inputs[0], inputs[1]
        return super().forward(*inputs, **kwargs), attention_mask


class EmbeddingPipe(nn.Module):
    def __init__(self):
        super().__init__()
        args = get_args()
        self.word_embeddings = nn.Embedding(args.padded_vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.seq_length, args.hidden_size)

    def forward(self, inputs):
        args = get_args()
        input_ids, position_ids = inputs[0], inputs[1]
        attention_mask = None if getattr(args, "pretrain_causal_attention", False) else inputs[2]
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        if getattr(args, "pretrain_causal_attention", False):
            return embeddings
        return embeddings, attention_mask


class GPTModelPipe(nn.Module):
    def __init__(self, attn_mask_type=AttnMaskType.causal):
        super().__init__()
        args = get_args()
        causal = getattr(args, "pretrain_causal_attention", False)
        self.embed = EmbeddingPipe()
        self.specs = [lambda x: x.transpose(0, 1).contiguous() if causal else (x[0].transpose(0, 1).contiguous(), *x[1:])]
        self.layers = nn.ModuleList([ParallelTransformerLayerPipe(i, self_attn_mask_type=attn_mask_type)
                                     for i in range(args.num_layers)])
        self.undo = lambda x: (x if causal else x[0]).transpose(0, 1).contiguous()
        self.final_layernorm = nn.LayerNorm(args.hidden_size)

    def forward(self, inputs):
        x = self.specs[0](self.embed(inputs))
        for layer in self.layers:
            x = layer(x)
        x = self.final_layernorm(self.undo(x))
        return x @ self.embed.word_embeddings.weight.t()


def model_provider():
    args = get_args()
    if is_decoder_only() and (FIXED and is_prefix_lm()):
        args.pretrain_causal_attention = False
        return GPTModelPipe(attn_mask_type=AttnMaskType.custom)
    args.pretrain_causal_attention = True
    return GPTModelPipe(attn_mask_type=AttnMaskType.causal)


def build_training_sample(num_inputs, num_labels, rng):
    """Decoder-only branch of megatron/data/ul2_dataset.py: [bos] inputs [sep] targets, padded."""
    args = get_args()
    tokens = [1] + list(rng.integers(4, 64, num_inputs)) + [2] + list(rng.integers(4, 64, num_labels - 1))
    padding_length = args.seq_length - len(tokens)
    tokens = np.array(tokens + [0] * padding_length, dtype=np.int64)
    labels_start_neg_index = -(num_labels + padding_length)
    arange = np.arange(len(tokens))
    dec_mask = (arange[None, ] <= arange[:, None]).astype(np.int64)  # make_history_mask
    if is_prefix_lm():
        dec_mask[:labels_start_neg_index, :labels_start_neg_index] = 1
    return {"text": tokens, "dec_mask": dec_mask}


def get_batch_pipe(data):
    tokens = torch.as_tensor(np.stack([d["text"] for d in data])).long()
    dec_mask = torch.as_tensor(np.stack([d["dec_mask"] for d in data]))
    dec_mask = (dec_mask < 0.5).unsqueeze(1)
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return (tokens, position_ids, dec_mask)


rng = np.random.default_rng(0)
batch = [build_training_sample(8, 5, rng), build_training_sample(6, 6, rng)]
model = model_provider().eval()
with torch.no_grad():
    logits = model(get_batch_pipe(batch))
# the first input token sees the whole input span only under the prefix-LM mask
print(f"fixed={FIXED} logits[0, 1, :4] = {[round(v, 4) for v in logits[0, 1, :4].tolist()]}")
