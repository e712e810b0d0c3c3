# pytorch/torchtitan#2560 (fixes #2559; commit 81b9f117b, "Yield per-document RoPE position ids from dataset").
#
# torchtitan pre-training packs tokenized documents (each <bos> ... <eos>) back to back into rows of
# seq_len + 1 tokens (HuggingFaceTextDataset._get_data_iter). With attn_mask_type="block_causal" the
# flex BlockMask (get_causal_mask_mod and get_document_mask_mod from EOS) keeps each document to
# itself, but before the fix the dataset yielded only {"input": input}: the Decoder got positions=None
# and RoPE used the row's columns 0..seq_len-1, so a document packed behind another one was rotated as
# if it started at the first one's length, not at 0 as inference (vLLM) runs it.
# The fix keeps a _position_buffer that restarts at 0 for every document, yields it as "positions",
# and the trainer passes it through extra_inputs to Decoder.forward(positions=...) (dropping it when
# the mask is plain causal). The model runs in bfloat16 (mixed_precision_param), as torchtitan trains it.
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import (
    and_masks,
    create_block_mask,
    flex_attention,
)

FIXED = "--fixed" in sys.argv


class CharTokenizer:
    """Stand-in for torchtitan's HuggingFaceTokenizer: bos/eos ids and encode()."""

    bos_id = 1
    eos_id = 2

    def encode(self, text, add_bos=True, add_eos=True):
        ids = [3 + (ord(c) % 60) for c in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])


class HuggingFaceTextDataset(torch.utils.data.IterableDataset):
    def __init__(self, texts, tokenizer, seq_len):
        self._data = [{"text": t} for t in texts]
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = False
        self._sample_idx = 0
        self._token_buffer: list[int] = []
        self._position_buffer: list[int] = []

    def _get_data_iter(self):
        return iter(self._data[self._sample_idx:])

    def __iter__(self):
        max_buffer_token_len = 1 + self.seq_len
        for sample in self._get_data_iter():
            sample_text = sample["text"]
            sample_tokens = self._tokenizer.encode(sample_text, add_bos=True, add_eos=True)
            self._token_buffer.extend(sample_tokens)
            if FIXED:
                self._position_buffer.extend(i % self.seq_len for i in range(len(sample_tokens)))
            self._sample_idx += 1

            while len(self._token_buffer) >= max_buffer_token_len:
                x = torch.LongTensor(self._token_buffer[:max_buffer_token_len])
                self._token_buffer = self._token_buffer[max_buffer_token_len:]
                input = x[:-1]
                label = x[1:]
                if FIXED:
                    pos = torch.LongTensor(self._position_buffer[:max_buffer_token_len])
                    self._position_buffer = self._position_buffer[max_buffer_token_len:]
                    positions = pos[:-1]
                    yield {"input": input, "positions": positions}, label
                else:
                    yield {"input": input}, label


# ---- torchtitan/models/common/attention.py ----
def get_causal_mask_mod():
    def _causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return _causal_mask


def get_document_mask_mod(batch, eos_id):
    eos_mask = batch == eos_id
    eos_mask[:, -1] = True
    cumulative_mask = torch.cumsum(torch.where(eos_mask, 1, 0), dim=1)
    sequence_indices = torch.zeros_like(cumulative_mask, dtype=torch.int32)
    sequence_indices[:, 1:] = cumulative_mask[:, :-1]

    def document_mask(b, h, q_idx, kv_idx):
        return sequence_indices[b, q_idx] == sequence_indices[b, kv_idx]

    return document_mask


def create_attention_mask(*args, **kwargs):
    return create_block_mask(*args, device="cpu", **kwargs)


# ---- torchtitan/models/common/rope.py (complex backend, llama3) ----
def precompute_freqs_cis(dim, end, theta=500000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def _reshape_for_broadcast_complex(freqs_cis, x, positions=None):
    ndim = x.ndim
    seqlen = x.shape[1]
    if positions is None:
        freqs_cis = freqs_cis[0:seqlen]
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)
    elif positions.size(0) == 1:
        freqs_cis = freqs_cis[positions.squeeze(0)]
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)
    else:
        freqs_cis_expanded = freqs_cis[None, :, None, :].expand(x.shape[0], -1, -1, -1)
        return torch.gather(
            freqs_cis_expanded,
            dim=1,
            index=positions.view(x.shape[0], seqlen, 1, 1).expand(
                x.shape[0], seqlen, 1, freqs_cis_expanded.shape[-1]
            ),
        )


def apply_rotary_emb_complex(xq, xk, freqs_cis, positions=None):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = _reshape_for_broadcast_complex(freqs_cis, xq_, positions)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


@dataclass
class AttentionConfig:
    n_heads: int = 4
    n_kv_heads: int = 2
    attn_backend: str = "flex"
    attn_mask_type: str = "block_causal"


@dataclass
class LayerConfig:
    attention: AttentionConfig = field(default_factory=AttentionConfig)


@dataclass
class DecoderConfig:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    max_seq_len: int = 64
    layer: LayerConfig = field(default_factory=LayerConfig)


class FlexAttentionWrapper(nn.Module):
    def forward(self, q, k, v, *, block_mask=None, scale=None, enable_gqa=False):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


class Attention(nn.Module):
    def __init__(self, config: AttentionConfig, *, dim: int):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = dim // config.n_heads
        self.enable_gqa = self.n_heads > self.n_kv_heads
        self.wq = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.inner_attention = FlexAttentionWrapper()

    def forward(self, x, rope_cache, attention_masks, positions=None):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb_complex(xq, xk, freqs_cis=rope_cache, positions=positions)
        xq = xq.transpose(1, 2)
        xk = xk.transpose(1, 2)
        xv = xv.transpose(1, 2)
        output = (
            self.inner_attention(xq, xk, xv, block_mask=attention_masks, enable_gqa=self.enable_gqa)
            .transpose(1, 2)
            .contiguous()
        )
        return self.wo(output.view(bs, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.attention = Attention(config.layer.attention, dim=config.dim)
        self.attention_norm = nn.RMSNorm(config.dim)
        self.ffn_norm = nn.RMSNorm(config.dim)
        self.feed_forward = nn.Sequential(
            nn.Linear(config.dim, 4 * config.dim), nn.SiLU(), nn.Linear(4 * config.dim, config.dim)
        )

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        h = x + self.attention(self.attention_norm(x), freqs_cis, attention_masks, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(config.dim // config.layer.attention.n_heads, config.max_seq_len),
            persistent=False,
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    @property
    def attn_config(self):
        return self.config.layer.attention

    def forward(self, tokens, attention_masks=None, positions=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, attention_masks, positions)
        return self.output(self.norm(h))

    def _get_flex_attention_masks(self, input_batch, tokenizer, extra_inputs=None):
        mask_mods = [get_causal_mask_mod()]
        match self.attn_config.attn_mask_type:
            case "causal":
                B = 1
            case "block_causal":
                B = input_batch.shape[0]
                mask_mods.append(get_document_mask_mod(input_batch, tokenizer.eos_id))
        return create_attention_mask(
            and_masks(*mask_mods), B, None, input_batch.shape[1], input_batch.shape[1]
        )

    def get_attention_masks(self, input_batch, tokenizer, extra_inputs=None):
        return self._get_flex_attention_masks(input_batch, tokenizer, extra_inputs)


class Trainer:
    def __init__(self, model, tokenizer):
        self.model_parts = [model]
        self.model_config = model.config
        self.tokenizer = tokenizer

    def post_dataloading_process(self, input_dict, labels):
        inputs = input_dict["input"]
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        extra_kwargs = {}
        layer = getattr(self.model_config, "layer", None)
        attn_config = getattr(layer, "attention", None) if layer else None
        if FIXED:
            attn_mask_type = getattr(attn_config, "attn_mask_type", "causal")
            if attn_mask_type != "block_causal":
                extra_inputs.pop("positions", None)
        attn_backend = getattr(attn_config, "attn_backend", "sdpa")
        if attn_backend in ["flex", "varlen"]:
            model = self.model_parts[0]
            extra_kwargs["attention_masks"] = model.get_attention_masks(
                input_batch=inputs, tokenizer=self.tokenizer, extra_inputs=extra_inputs
            )
        return inputs, labels, extra_inputs, extra_kwargs

    @torch.no_grad()
    def validate_step(self, input_dict, labels):
        # Validator.validate: the same post-processing, forward only (flex has no CPU backward)
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(input_dict, labels)
        pred = self.model_parts[0](inputs, **extra_inputs, **extra_kwargs)
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def main():
    torch.manual_seed(0)
    seq_len = 32
    tokenizer = CharTokenizer()
    texts = [
        "the cat sat on the mat",
        "a dog ran far",
        "packed rows hold many docs",
        "short one",
        "rotary positions start at zero",
        "end",
    ]
    dataset = HuggingFaceTextDataset(texts, tokenizer, seq_len)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    config = DecoderConfig(max_seq_len=seq_len)
    # training.mixed_precision_param = "bfloat16"
    model = Decoder(config).to(torch.bfloat16)
    trainer = Trainer(model, tokenizer)
    model.eval()
    for step, (input_dict, labels) in enumerate(loader):
        loss = trainer.validate_step(input_dict, labels)
        print(f"validation step {step}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
