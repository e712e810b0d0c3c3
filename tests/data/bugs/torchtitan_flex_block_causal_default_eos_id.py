"""torchtitan llama3 + FlexAttention block_causal: eos_id never propagated from the tokenizer.

Citation: pytorch/torchtitan#1144 "Synchronize the `eos_id` from the tokenizer to the model's
`eos_id`" (bug report by the author of the fix; maintainer: "Thanks for the fix"). I read the issue
thread, not the fix diff; the fix as rendered here is the one the title states.

torchtitan's FlexAttention ``block_causal`` mask splits a packed training row into documents at
every token equal to ``eos_id``: ``_get_block_causal_mask_fn(batch, eos_id)`` turns
``batch == eos_id`` into a document index per token and the mask_mod allows
``seq_idx[b, q] == seq_idx[b, kv] and q >= kv``. The model takes ``eos_id`` from its
``TransformerModelArgs`` (default 0), and ``update_from_config(job_config, tokenizer)`` copied the
tokenizer's vocab size and the training seq_len into the model args but not the tokenizer's
``eos_id``. So the block-causal mask looked for token 0, found no boundary, and every packed
document attended to the documents before it. The fix sets ``self.eos_id = tokenizer.eos_id`` in
``update_from_config``.

This program: the model args dataclass, a job config, a tokenizer whose eos_id is 2, the
FlexAttention wrapper with its class-level block masks (built with ``create_block_mask`` and run
with ``flex_attention`` in eager mode on CPU), and a two-layer llama-style Transformer. One row of
16 tokens packs three documents ended by eos.
"""
import sys
import warnings
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv
# Eager flex_attention (no torch.compile) is intended here: CPU, tiny sizes.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


@dataclass
class Training:
    seq_len: int = 16


@dataclass
class JobConfig:
    training: Training


class Tokenizer:
    """Stands for the test tokenizer: bos 1, eos 2."""

    n_words = 64
    bos_id = 1
    eos_id = 2


@dataclass
class TransformerModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = -1
    max_seq_len: int = 2048
    use_flex_attn: bool = True
    attn_mask_type: str = "block_causal"
    eos_id: int = 0

    def update_from_config(self, job_config: JobConfig, tokenizer: Tokenizer) -> None:
        self.vocab_size = tokenizer.n_words
        self.max_seq_len = job_config.training.seq_len
        if FIXED:
            self.eos_id = tokenizer.eos_id


class FlexAttention(nn.Module):
    used_attn_mask_types: ClassVar[set] = set()
    block_masks: ClassVar[dict] = {}

    def __init__(self, attn_mask_type: str) -> None:
        super().__init__()
        if attn_mask_type not in ["causal", "block_causal"]:
            raise ValueError(f"Unrecognized attn_mask_type {attn_mask_type}.")
        self.attn_mask_type = attn_mask_type
        FlexAttention.used_attn_mask_types.add(attn_mask_type)

    def forward(self, q, k, v, scale: Optional[float] = None):
        block_mask = FlexAttention.block_masks[self.attn_mask_type]
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)

    @staticmethod
    def _get_causal_mask_fn():
        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        return causal_mask

    @staticmethod
    def _get_block_causal_mask_fn(batch: torch.Tensor, eos_id: int):
        # batch is [b, s] token ids
        mask = batch == eos_id
        mask[:, -1] = True
        acc_mask = torch.cumsum(torch.where(mask, 1, 0), dim=1)
        seq_idx = torch.zeros_like(acc_mask, dtype=torch.int32)
        seq_idx[:, 1:] = acc_mask[:, :-1]

        def block_causal_mask(b, h, q_idx, kv_idx):
            return (seq_idx[b, q_idx] == seq_idx[b, kv_idx]) & (q_idx >= kv_idx)

        return block_causal_mask

    @staticmethod
    @torch.no_grad()
    def init_attention_mask(batch: torch.Tensor, eos_id: Optional[int] = None) -> None:
        for attn_mask_type in FlexAttention.used_attn_mask_types:
            if attn_mask_type == "causal":
                batch_dimension = 1
                mask_fn = FlexAttention._get_causal_mask_fn()
            else:
                if eos_id is None:
                    raise RuntimeError("eos_id must be provided for block_causal mask.")
                batch_dimension = batch.shape[0]
                mask_fn = FlexAttention._get_block_causal_mask_fn(batch, eos_id)
            seq_len = batch.shape[1]
            block_mask: BlockMask = create_block_mask(mask_fn, batch_dimension, None, seq_len, seq_len, device="cpu")
            FlexAttention.block_masks[attn_mask_type] = block_mask


class Attention(nn.Module):
    def __init__(self, model_args: TransformerModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.dim, bias=False)
        self.wk = nn.Linear(model_args.dim, model_args.dim, bias=False)
        self.wv = nn.Linear(model_args.dim, model_args.dim, bias=False)
        self.wo = nn.Linear(model_args.dim, model_args.dim, bias=False)
        self.use_flex_attn = model_args.use_flex_attn
        self.sdpa = FlexAttention(model_args.attn_mask_type)

    def forward(self, x):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xk = self.wk(x).view(bs, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xv = self.wv(x).view(bs, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        output = self.sdpa(xq, xk, xv)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, model_args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(model_args.dim)
        self.attention = Attention(model_args)
        self.ffn_norm = nn.RMSNorm(model_args.dim)
        self.feed_forward = nn.Sequential(nn.Linear(model_args.dim, 4 * model_args.dim), nn.SiLU(),
                                          nn.Linear(4 * model_args.dim, model_args.dim))

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, model_args: TransformerModelArgs):
        super().__init__()
        self.model_args = model_args
        self.eos_id = model_args.eos_id
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleList([TransformerBlock(model_args) for _ in range(model_args.n_layers)])
        self.norm = nn.RMSNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor):
        if self.model_args.use_flex_attn:
            FlexAttention.init_attention_mask(tokens, eos_id=self.eos_id)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def main():
    torch.manual_seed(0)
    job_config = JobConfig(training=Training(seq_len=16))
    tokenizer = Tokenizer()
    model_args = TransformerModelArgs()
    model_args.update_from_config(job_config, tokenizer)
    model = Transformer(model_args).eval()

    # Packed row: three documents, each "bos ... eos", as the pretraining dataloader emits them.
    docs = [[1, 17, 23, 9, 2], [1, 40, 33, 12, 51, 2], [1, 8, 19, 27, 44]]
    inputs = torch.tensor([sum(docs, [])])
    labels = torch.roll(inputs, -1, dims=1)
    with torch.no_grad():
        pred = model(inputs)
        loss = F.cross_entropy(pred[0, :-1], labels[0, :-1])
    print("eos_id used for the block mask:", model.eos_id, "loss:", round(float(loss), 4))


if __name__ == "__main__":
    main()
