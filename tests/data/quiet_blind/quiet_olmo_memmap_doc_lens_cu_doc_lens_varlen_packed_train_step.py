# Correct program (quiet batch quiet-r123b).
# Ported from allenai/OLMo @59a53e3f68e546330ca5a99ec626e58f9ab96494:
#   olmo/data/util.py get_document_lengths (document boundaries from EOS, last document runs to the end of the row),
#   olmo/data/memmap_dataset.py MemMapDataset.__getitem__ (generate_doc_lengths -> item["doc_lens"]),
#   olmo/data/collator.py DataCollator (doc_lens right-padded with 0 to max_docs, max_doc_lens per row),
#   olmo/torch_util.py get_cumulative_document_lengths (zeros dropped, cumsum over the flattened batch),
#   olmo/model.py OLMo.forward (doc_lens -> max_doc_len / cu_doc_lens; attention_bias stays None so is_causal=True),
#   OLMoBlock.attention / _scaled_dot_product_attention (q, k, v viewed as (B * T, n_heads, head_dim) and handed to
#   flash_attn_varlen_func(cu_doc_lens, cu_doc_lens, max_doc_len, max_doc_len, causal=is_causal)), RotaryEmbedding
#   (positions over the whole row), OLMoSequentialBlock; olmo/train.py Trainer.get_labels / model_forward /
#   train_micro_batch (loss_reduction="sum" divided by the tokens in the batch).
# flash-attn does not run on CPU, so the block is handed a varlen function with flash's signature that builds the
# document-causal mask by hand from cu_seqlens and calls SDPA over the flattened tokens.
# Two rows of 16 tokens from an EOS-delimited token stream: row 0 holds documents of 5, 7 and 4 tokens (the last one
# cut by the chunk, no EOS), row 1 the 2-token rest of that document and one of 14 (doc_lens padded with a 0). The self-check runs every document alone through the same
# model (no doc_lens: plain causal SDPA, positions from 0) and compares every logit, before and after an AdamW step.
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import einsum

torch.manual_seed(0)


@dataclass
class ModelConfig:
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    vocab_size: int = 64
    embedding_size: int = 64
    max_sequence_length: int = 32
    rope: bool = True
    rope_theta: float = 10000.0
    rope_full_precision: bool = True
    include_bias: bool = False
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    init_std: float = 0.02
    eos_token_id: int = 2
    pad_token_id: int = 1


def get_document_lengths(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    doc_boundaries = torch.cat(
        [
            torch.tensor([-1], dtype=torch.int32),
            (input_ids == eos_token_id).nonzero(as_tuple=True)[0].to(dtype=torch.int32),
            torch.tensor([] if input_ids[-1] == eos_token_id else [input_ids.shape[0] - 1], dtype=torch.int32),
        ]
    )
    return doc_boundaries[1:] - doc_boundaries[:-1]


def get_cumulative_document_lengths(doc_lens: torch.Tensor) -> torch.Tensor:
    """
    Transform a batched tensor of document lengths into a 1D tensor of cumulative document
    lengths for the whole batch.
    """
    return torch.cat(
        [
            torch.tensor([0], dtype=torch.int32, device=doc_lens.device),
            torch.cumsum(doc_lens.masked_select(doc_lens != 0), 0, dtype=torch.int32),
        ]
    )


@dataclass
class DataCollator:
    pad_token_id: int

    def __call__(self, items: List[Dict[str, Any]]) -> Dict[str, Any]:
        max_len = max(len(x["input_ids"]) for x in items)
        max_docs = max((len(x["doc_lens"]) if "doc_lens" in x else 0 for x in items))
        all_input_ids, all_doc_lens, all_max_doc_lens = [], [], []
        for x in items:
            input_ids = x["input_ids"]
            pad_shape = (0, max_len - len(input_ids))
            all_input_ids.append(F.pad(input_ids.to(dtype=torch.long), pad_shape, value=self.pad_token_id))
            doc_lens = x.get("doc_lens")
            if doc_lens is not None:
                doc_pad_shape = (0, max_docs - len(doc_lens))
                all_doc_lens.append(F.pad(doc_lens, doc_pad_shape, value=0))
                all_max_doc_lens.append(int(doc_lens.max()))
        out: Dict[str, Any] = {"input_ids": torch.stack(all_input_ids)}
        if all_doc_lens:
            out["doc_lens"] = torch.stack(all_doc_lens)
        if all_max_doc_lens:
            out["max_doc_lens"] = all_max_doc_lens
        return out


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, causal=False
):
    """CPU stand-in for flash_attn.flash_attn_varlen_func: q (total_q, nheads, d), k / v (total_k, nheads, d)."""
    total_q, total_k = q.shape[0], k.shape[0]
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    seq_q = torch.repeat_interleave(torch.arange(len(lens_q), device=q.device), lens_q, output_size=total_q)
    seq_k = torch.repeat_interleave(torch.arange(len(lens_k), device=k.device), lens_k, output_size=total_k)
    pos_q = torch.arange(total_q, device=q.device) - cu_seqlens_q.long()[seq_q]
    pos_k = torch.arange(total_k, device=k.device) - cu_seqlens_k.long()[seq_k]
    allowed = seq_q[:, None] == seq_k[None, :]
    if causal:
        # flash aligns the causal diagonal to the bottom-right corner of each sequence's block
        allowed = allowed & (pos_k[None, :] <= pos_q[:, None] + (lens_k - lens_q)[seq_q][:, None])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=allowed[None, None],
        dropout_p=dropout_p,
    )
    return out.squeeze(0).transpose(0, 1)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, cache: Dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        self.__cache = cache
        self.get_rotary_embedding(config.max_sequence_length, torch.device("cpu"))

    def get_rotary_embedding(self, seq_len: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        if (
            (pos_sin := self.__cache.get("rope_pos_sin")) is not None
            and (pos_cos := self.__cache.get("rope_pos_cos")) is not None
            and pos_sin.shape[-2] >= seq_len
            and pos_cos.shape[-2] >= seq_len
        ):
            return pos_sin[:, :, :seq_len, :], pos_cos[:, :, :seq_len, :]
        dim = self.config.d_model // self.config.n_heads
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim))
        seq = torch.arange(seq_len, device=device, dtype=torch.float)
        freqs = einsum("i , j -> i j", seq, inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        pos_sin, pos_cos = positions.sin()[None, None, :, :], positions.cos()[None, None, :, :]
        self.__cache["rope_pos_sin"] = pos_sin
        self.__cache["rope_pos_cos"] = pos_cos
        return pos_sin, pos_cos

    def rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        B, nh, T, hs = x.size()
        x = x.view(B, nh, T, 2, hs // 2)
        x1, x2 = x.unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(self, pos_sin: torch.Tensor, pos_cos: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((t * pos_cos) + (self.rotate_half(t) * pos_sin)).to(t.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        q_, k_ = (q.float(), k.float()) if self.config.rope_full_precision else (q, k)
        query_len, key_len = q_.shape[-2], k_.shape[-2]
        pos_sin, pos_cos = self.get_rotary_embedding(key_len, q_.device)
        pos_sin = pos_sin.type_as(q_)
        pos_cos = pos_cos.type_as(q_)
        q_ = self.apply_rotary_pos_emb(
            pos_sin[:, :, key_len - query_len : key_len, :],
            pos_cos[:, :, key_len - query_len : key_len, :],
            q_,
        )
        k_ = self.apply_rotary_pos_emb(pos_sin, pos_cos, k_)
        return q_.type_as(q), k_.type_as(k)


class SwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class OLMoSequentialBlock(nn.Module):
    def __init__(self, layer_id: int, config: ModelConfig, cache: Dict[str, torch.Tensor]):
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.hidden_size = config.mlp_ratio * config.d_model
        self.dropout = nn.Dropout(config.residual_dropout)
        self.act = SwiGLU()
        self.attn_out = nn.Linear(config.d_model, config.d_model, bias=config.include_bias)
        self.ff_out = nn.Linear(self.hidden_size // 2, config.d_model, bias=config.include_bias)
        self.rotary_emb = RotaryEmbedding(config, cache)
        self.flash_attn_varlen_func = flash_attn_varlen_func
        self.fused_dims = (config.d_model, config.d_model, config.d_model)
        self.att_proj = nn.Linear(config.d_model, sum(self.fused_dims), bias=config.include_bias)
        self.ff_proj = nn.Linear(config.d_model, self.hidden_size, bias=config.include_bias)
        self.attn_norm = nn.LayerNorm(config.d_model, elementwise_affine=False)
        self.ff_norm = nn.LayerNorm(config.d_model, elementwise_affine=False)
        for lin in (self.att_proj, self.ff_proj, self.attn_out, self.ff_out):
            nn.init.normal_(lin.weight, std=config.init_std * 10)

    def _scaled_dot_product_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        max_doc_len: Optional[int] = None,
        cu_doc_lens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if max_doc_len is not None and cu_doc_lens is not None:
            assert self.flash_attn_varlen_func is not None, "flash-attn is required for document masking"
            assert attn_mask is None, "attn-mask is currently not supported with document masking"
            B, T, D = q.size(0), q.size(2), q.size(3)
            r = self.flash_attn_varlen_func(
                q.transpose(1, 2).view(B * T, -1, D),
                k.transpose(1, 2).view(B * T, -1, D),
                v.transpose(1, 2).view(B * T, -1, D),
                cu_doc_lens,
                cu_doc_lens,
                max_doc_len,
                max_doc_len,
                dropout_p=dropout_p,
                causal=is_causal,
            )
            return r.view(B, T, -1, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_bias: Optional[torch.Tensor] = None,
        max_doc_len: Optional[int] = None,
        cu_doc_lens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        B, T, C = q.size()
        q = q.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        k = k.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        v = v.view(B, T, self.config.n_heads, C // self.config.n_heads).transpose(1, 2)
        if self.config.rope:
            q, k = self.rotary_emb(q, k)
        att = self._scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_bias,
            dropout_p=0.0 if not self.training else self.config.attention_dropout,
            is_causal=attention_bias is None,
            max_doc_len=max_doc_len,
            cu_doc_lens=cu_doc_lens,
        )
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att)

    def forward(self, x, attention_bias=None, max_doc_len=None, cu_doc_lens=None):
        h = self.attn_norm(x)
        q, k, v = self.att_proj(h).split(self.fused_dims, dim=-1)
        att = self.attention(q, k, v, attention_bias, max_doc_len=max_doc_len, cu_doc_lens=cu_doc_lens)
        x = x + self.dropout(att)
        og_x = x
        x = self.ff_norm(x)
        x = self.ff_proj(x)
        x = self.act(x)
        x = self.ff_out(x)
        x = self.dropout(x)
        return og_x + x


class OLMo(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.__cache: Dict[str, torch.Tensor] = {}
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.embedding_size, config.d_model),
                emb_drop=nn.Dropout(config.embedding_dropout),
                ln_f=nn.LayerNorm(config.d_model, elementwise_affine=False),
                blocks=nn.ModuleList([OLMoSequentialBlock(i, config, self.__cache) for i in range(config.n_layers)]),
                ff_out=nn.Linear(config.d_model, config.embedding_size, bias=False),
            )
        )

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_bias: Optional[torch.Tensor] = None,
        doc_lens: Optional[torch.Tensor] = None,
        max_doc_lens: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        max_doc_len: Optional[int] = None
        cu_doc_lens: Optional[torch.Tensor] = None
        if doc_lens is not None and max_doc_lens is not None:
            max_doc_len = max(max_doc_lens)
            cu_doc_lens = get_cumulative_document_lengths(doc_lens)
        x = self.transformer.wte(input_ids)
        x = self.transformer.emb_drop(x)
        for block in self.transformer.blocks:
            x = block(x, attention_bias=attention_bias, max_doc_len=max_doc_len, cu_doc_lens=cu_doc_lens)
        x = self.transformer.ln_f(x)
        return self.transformer.ff_out(x)


def get_labels(batch: Dict[str, Any]) -> torch.Tensor:
    # Labels are just input IDs shifted to the left (first item is ignored).
    labels = batch["input_ids"].clone()
    return labels[..., 1:].contiguous()


def model_forward(model: OLMo, batch: Dict[str, Any], loss_reduction: str = "mean"):
    logits = model(input_ids=batch["input_ids"], doc_lens=batch.get("doc_lens"), max_doc_lens=batch.get("max_doc_lens"))
    logits_for_loss = logits[..., :-1, :].contiguous().view(-1, logits.size(-1))
    labels = get_labels(batch).view(-1)
    ce_loss = F.cross_entropy(logits_for_loss, labels, ignore_index=-100, reduction=loss_reduction)
    return ce_loss, logits


def per_document_logits(model: OLMo, batch: Dict[str, Any]) -> torch.Tensor:
    """Every document alone (no doc_lens: plain causal attention, RoPE from position 0), laid back into its row."""
    out = []
    for row, doc_lens in zip(batch["input_ids"], batch["doc_lens"]):
        start, pieces = 0, []
        for n in doc_lens.tolist():
            if n == 0:
                continue
            pieces.append(model(input_ids=row[start : start + n].unsqueeze(0))[0])
            start += n
        assert start == row.numel()
        out.append(torch.cat(pieces, dim=0))
    return torch.stack(out)


def main() -> None:
    config = ModelConfig()
    eos = config.eos_token_id
    seq_len = 16

    # An EOS-terminated token stream, chunked into fixed-length instances as MemMapDataset reads them.
    docs = [5, 7, 6, 14]
    stream = []
    for n in docs:
        stream += torch.randint(3, config.vocab_size, (n - 1,)).tolist() + [eos]
    stream = torch.tensor(stream[: 2 * seq_len])
    items = []
    for i in range(2):
        input_ids = stream[i * seq_len : (i + 1) * seq_len]
        items.append({"input_ids": input_ids, "doc_lens": get_document_lengths(input_ids, eos)})
    assert items[0]["doc_lens"].tolist() == [5, 7, 4] and items[1]["doc_lens"].tolist() == [2, 14]

    batch = DataCollator(pad_token_id=config.pad_token_id)(items)
    assert batch["doc_lens"].tolist() == [[5, 7, 4], [2, 14, 0]] and batch["max_doc_lens"] == [7, 14]
    assert get_cumulative_document_lengths(batch["doc_lens"]).tolist() == [0, 5, 12, 16, 18, 32]

    model = OLMo(config)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch_size_in_tokens = batch["input_ids"].numel()

    for step in range(3):
        model.train()
        ce_loss, logits = model_forward(model, batch, loss_reduction="sum")
        loss = ce_loss / batch_size_in_tokens
        with torch.no_grad():
            ref = per_document_logits(model, batch)
        err = (logits.detach() - ref).abs().max().item()
        assert err < 1e-4, (step, err)
        ref_loss = F.cross_entropy(
            ref[:, :-1].reshape(-1, ref.size(-1)), get_labels(batch).view(-1), reduction="sum"
        ) / batch_size_in_tokens
        assert math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-5), (loss.item(), ref_loss.item())
        print(f"step {step}: loss {loss.item():.4f}  max |packed - per-document| logit {err:.2e}")
        optim.zero_grad()
        loss.backward()
        optim.step()

    print("packed doc_lens forward matches every document run alone")


if __name__ == "__main__":
    main()
