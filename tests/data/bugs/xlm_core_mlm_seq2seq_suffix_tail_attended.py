# Citation: dhruvdcoder/xlm-core#47, fixed by dhruvdcoder/xlm-core#48
#   (commit 3e33878, "Fix MLM seq2seq training suffix window to match inference";
#   merge 59c94a8). Buggy parent 3e33878^.
# Upstream: xlm-models/mlm/datamodule_mlm.py (prepare_prefix_suffix_ids,
#   MLMSeq2SeqTrainCollator), xlm-models/mlm/loss_mlm.py (MLMLoss.loss_fn),
#   xlm-models/mlm/model_mlm.py (RotaryTransformerMLMModel),
#   src/xlm/modules/rotary_transformer.py (RotaryTransformerLayer, SDPA),
#   src/xlm/modules/position.py (RotaryEmbedding), src/xlm/utils/nn.py.
# Bug: the masked-diffusion (MLM) seq2seq training collator pads every example on the
#   right to input_block_size + block_size and, with loss_on_padding (the STAR configs'
#   default), gives the whole row attention_mask = 1 and makes every position after the
#   prompt mask-eligible. A short prompt thus trains with (input_block_size - len(prompt))
#   + block_size suffix positions that the bidirectional encoder attends, while inference
#   (MLMSeq2SeqPredCollator) only ever gives block_size masked slots after the prompt.
# Fix: suffix_block_size=block_size: the suffix (+ EOS) is padded/truncated to exactly
#   block_size slots, attention_mask = 0 beyond prefix + BOS + block_size, the hidden
#   tail is not mask-eligible and its targets are -100.
# Port notes: xlm's Tokenizer / NoiseSchedule / Harness replaced by small stand-ins;
#   tiny sizes, dropout 0, one training step on a STAR-style batch.
import copy
import sys
from typing import Any, List, Literal, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

FIXED = "--fixed" in sys.argv
TT = torch.Tensor


# ------------------------------------------------------------ src/xlm/utils/nn.py
def pad_truncate_list(
    ids: List[Any],
    max_len: int,
    pad_token: Any,
    pad_left: bool = False,
) -> List[Any]:
    num_padded = max_len - len(ids)
    pad_values = [pad_token] * num_padded
    if not pad_left:
        padded = ids[:max_len] + pad_values
    else:
        padded = pad_values + ids[-max_len:]
    return padded


def masked_mean(vector, mask, dim, keepdim=False):
    replaced_vector = vector.masked_fill(~mask, 0.0)
    value_sum = torch.sum(replaced_vector, dim=dim, keepdim=keepdim)
    value_count = torch.sum(mask, dim=dim, keepdim=keepdim).to(dtype=vector.dtype) + 1e-9
    return value_sum / value_count


# ------------------------------------------------- xlm-models/mlm/datamodule_mlm.py
def prepare_prefix_suffix_ids(
    prefix_ids: List[List[int]],
    suffix_ids: List[List[int]],
    pad_token_id: int,
    mask_token_id: int,
    eos_token_id: Optional[int] = None,
    bos_token_id: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    truncate: Literal["max", "block", None] = "block",
    loss_on_padding: bool = True,
    suffix_block_size: Optional[int] = None,
):
    """Prepare concatenated prefix and suffix ids for seq2seq tasks with padding on the right only"""
    input_ids: List[TT] = []
    attention_mask: List[TT] = []
    target_ids: List[TT] = []
    mask: List[TT] = []
    add_eos = int(eos_token_id is not None)
    add_bos = int(bos_token_id is not None)
    if truncate in ["max", None]:
        if suffix_block_size is not None:
            max_len = max(
                len(_prefix_ids) + add_bos + suffix_block_size
                for _prefix_ids, _suffix_ids in zip(prefix_ids, suffix_ids)
            )
        else:
            max_len = max(
                len(_prefix_ids) + len(_suffix_ids) + add_eos + add_bos
                for _prefix_ids, _suffix_ids in zip(prefix_ids, suffix_ids)
            )
        if truncate == "max" and max_seq_len is not None:
            max_len = max(max_len, max_seq_len)
    elif truncate == "block" and max_seq_len is not None:
        max_len = max_seq_len
    else:
        raise ValueError(f"Invalid truncate, max_seq_len: {max_seq_len}")
    batch_size = len(prefix_ids)
    t = torch.rand(batch_size)
    for i, (_prefix_ids, _suffix_ids) in enumerate(zip(prefix_ids, suffix_ids)):
        if suffix_block_size is not None:
            suffix_slot = pad_truncate_list(
                _suffix_ids + [eos_token_id] * add_eos,
                suffix_block_size,
                pad_token_id,
                pad_left=False,
            )
            content = _prefix_ids + ([bos_token_id] * add_bos) + suffix_slot
            visible_len = len(_prefix_ids) + add_bos + suffix_block_size
            temp = pad_truncate_list(content, max_len, pad_token_id, pad_left=False)
            effective_visible = min(visible_len, len(temp))
            suffix_mask = pad_truncate_list(
                [0] * (len(_prefix_ids) + add_bos) + [1] * suffix_block_size,
                max_len,
                0,
                pad_left=False,
            )
            _mask = (torch.rand(len(temp)) < t[i]).logical_and(
                torch.tensor(suffix_mask, dtype=torch.bool)
            )
            _input_ids = torch.tensor(temp, dtype=torch.long)
            input_ids.append(_input_ids)
            _attn = torch.zeros(len(temp), dtype=torch.bool)
            _attn[:effective_visible] = True
            attention_mask.append(_attn)
            _target_ids = _input_ids.clone()
            _target_ids[effective_visible:] = -100
            if not loss_on_padding:
                content_len = len(_prefix_ids) + add_bos + len(_suffix_ids) + add_eos
                for j in range(min(content_len, effective_visible), effective_visible):
                    _target_ids[j] = -100
            target_ids.append(_target_ids)
            mask.append(_mask)
        else:
            # bos should not be masked
            suffix_mask = pad_truncate_list(
                [0] * (len(_prefix_ids) + add_bos) + [1] * (len(_suffix_ids) + add_eos),
                max_len,
                1,
                pad_left=False,
            )
            temp = pad_truncate_list(
                _prefix_ids
                + ([bos_token_id] * add_bos)
                + _suffix_ids
                + ([eos_token_id] * add_eos),
                max_len,
                pad_token_id,
                pad_left=False,
            )
            _mask = (torch.rand(len(temp)) < t[i]).logical_and(
                torch.tensor(suffix_mask, dtype=torch.bool)
            )
            _input_ids = torch.tensor(temp, dtype=torch.long)
            input_ids.append(_input_ids)
            if loss_on_padding:
                attention_mask.append(torch.tensor([1] * len(temp), dtype=torch.bool))
                target_ids.append(_input_ids.clone())
                mask.append(_mask)
            else:
                attention_mask.append(
                    torch.tensor(
                        pad_truncate_list(
                            [1] * (len(_prefix_ids) + len(_suffix_ids) + add_eos + add_bos),
                            max_len,
                            0,
                            pad_left=False,
                        ),
                        dtype=torch.bool,
                    )
                )
                mask.append(_mask.logical_and(attention_mask[-1]))
                _target_ids = _input_ids.clone()
                _target_ids[~attention_mask[-1]] = -100  # no loss on padding
                target_ids.append(_target_ids)
    target_ids = torch.stack(target_ids, dim=0)
    attention_mask = torch.stack(attention_mask, dim=0)
    input_ids = torch.stack(input_ids, dim=0)
    mask = torch.stack(mask, dim=0)
    input_ids[mask] = mask_token_id
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "target_ids": target_ids,
    }


class MLMSeq2SeqTrainCollator:
    """MLM training for seq2seq tasks. Padding is done on the right."""

    def __init__(
        self,
        tokenizer,
        noise_schedule,
        block_size: Optional[int] = None,
        input_block_size: Optional[int] = None,
        add_bos: bool = True,
        add_eos: bool = True,
        truncate: Literal["max", "block", None] = "block",
        loss_on_padding: bool = True,
        target_field: str = "target_ids",
    ):
        self.tokenizer = tokenizer
        self.noise_schedule = noise_schedule
        self.block_size = block_size
        self.input_block_size = input_block_size
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.truncate = truncate
        self.loss_on_padding = loss_on_padding
        self.target_field = target_field

    def __call__(self, examples):
        suffix_lists = [list(e[self.target_field]) for e in examples]
        if not FIXED:
            prefix_suffix = prepare_prefix_suffix_ids(
                [e["prompt_ids"] for e in examples],
                suffix_lists,
                self.tokenizer.pad_token_id,
                self.tokenizer.mask_token_id,
                eos_token_id=self.tokenizer.eos_token_id if self.add_eos else None,
                bos_token_id=self.tokenizer.bos_token_id if self.add_bos else None,
                max_seq_len=(self.input_block_size + self.block_size),
                truncate=self.truncate,
                loss_on_padding=self.loss_on_padding,
            )
            return prefix_suffix
        if self.input_block_size == 0:
            max_seq_len = None
            truncate = None
        else:
            max_seq_len = self.input_block_size + self.block_size
            truncate = self.truncate
        prefix_suffix = prepare_prefix_suffix_ids(
            [e["prompt_ids"] for e in examples],
            suffix_lists,
            self.tokenizer.pad_token_id,
            self.tokenizer.mask_token_id,
            eos_token_id=self.tokenizer.eos_token_id if self.add_eos else None,
            bos_token_id=self.tokenizer.bos_token_id if self.add_bos else None,
            max_seq_len=max_seq_len,
            truncate=truncate,
            loss_on_padding=self.loss_on_padding,
            suffix_block_size=self.block_size,
        )
        return prefix_suffix


# ------------------------------------------------------- src/xlm/modules/position.py
class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, head_first: bool = True, cache_size: int = 1024):
        super().__init__()
        self.dim = dim
        self.head_first = head_first
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        cache_size += 1
        angles = self.get_angles(cache_size)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.seq_len = cache_size

    def forward(self, x, positions):
        if not self.head_first:
            sin = F.embedding(positions, self.sin).unsqueeze(-2)
            cos = F.embedding(positions, self.cos).unsqueeze(-2)
        else:
            sin = F.embedding(positions, self.sin).unsqueeze(-3)  # (bsz, 1, seq_len, dim/2)
            cos = F.embedding(positions, self.cos).unsqueeze(-3)
        x_rope_1, x_rope_2 = x.chunk(2, dim=-1)
        return torch.cat(
            [x_rope_1 * cos - x_rope_2 * sin, x_rope_2 * cos + x_rope_1 * sin], dim=-1
        )

    def get_angles(self, seq_len: int) -> torch.Tensor:
        t = torch.arange(seq_len, device=self.inv_freq.device).type_as(self.inv_freq)
        return torch.einsum("i,j->ij", t, self.inv_freq)


# ----------------------------------------------- src/xlm/modules/rotary_transformer.py
def add_bias_apply_dropout_scale(x, bias=None, dropout=0.0, scale=None, residual=None, training=True):
    if bias is not None:
        x = x + bias
    if scale is not None:
        x = x * scale
    x = F.dropout(x, p=dropout, training=training)
    if residual is not None:
        x = residual + x
    return x


class RotaryTransformerLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=None, dropout=0.1,
                 activation="relu", layer_norm_eps=1e-5, force_flash_attn=False):
        super().__init__()
        dim_feedforward = dim_feedforward or 4 * d_model
        self.n_heads = nhead
        self.dim = d_model
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.head_dim = d_model // nhead
        self.rotary_emb = None
        self.attn_qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        act = nn.GELU(approximate="tanh") if activation == "gelu" else nn.ReLU()
        self.mlp = nn.Sequential(
            nn.Linear(d_model, dim_feedforward, bias=True),
            act,
            nn.Linear(dim_feedforward, d_model, bias=True),
        )
        self.dropout = dropout
        self.force_flash_attn = force_flash_attn
        if force_flash_attn:
            self.attn_backend = [SDPBackend.FLASH_ATTENTION]
        else:
            self.attn_backend = [
                SDPBackend.FLASH_ATTENTION,
                SDPBackend.MATH,
                SDPBackend.EFFICIENT_ATTENTION,
            ]

    def set_rotary_emb(self, rotary_emb=None):
        self.rotary_emb = rotary_emb
        self.rotary_emb_dim = rotary_emb.dim

    def forward(self, inp, attention_mask, positions=None, block_mask=None):
        x = self.norm1(inp)
        seq_len = x.shape[1]
        qkv = self.attn_qkv(x)
        q, k, v = qkv.chunk(3, dim=-1)
        q = q.view(q.shape[0], q.shape[1], self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(k.shape[0], k.shape[1], self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(v.shape[0], v.shape[1], self.n_heads, self.head_dim).transpose(1, 2)
        q_rotary = self.apply_rotary_pos_emb(q, positions)
        k_rotary = self.apply_rotary_pos_emb(k, positions)

        attn_mask = None
        if attention_mask is not None:
            if attention_mask.ndim == 2:  # (bsz, seq_len)
                attn_mask = attention_mask.unsqueeze(1).unsqueeze(1)  # (bsz, 1, 1, seq_len)
            elif attention_mask.ndim == 3:
                attn_mask = attention_mask.unsqueeze(1)
            else:
                raise ValueError(f"bad attention mask shape {attention_mask.shape}")
        with torch.nn.attention.sdpa_kernel(self.attn_backend):
            attn_output = F.scaled_dot_product_attention(
                q_rotary,
                k_rotary,
                v,
                attn_mask=attn_mask,
                dropout_p=self.dropout if self.training else 0.0,
            )
        attn_output = attn_output.transpose(1, 2).contiguous().view(x.shape[0], seq_len, self.dim)
        x_attn = self.o_proj(attn_output)
        inp = add_bias_apply_dropout_scale(
            x_attn, dropout=self.dropout, residual=inp, training=self.training
        )
        inp = add_bias_apply_dropout_scale(
            self.mlp(self.norm2(inp)), dropout=self.dropout, residual=inp, training=self.training
        )
        return inp

    def apply_rotary_pos_emb(self, x, positions=None):
        x_rope = x[..., : self.rotary_emb_dim]
        x_pass = x[..., self.rotary_emb_dim:]
        x_rotated = self.rotary_emb(x_rope, positions)
        return torch.cat([x_rotated, x_pass], dim=-1)


class RotaryTransformerLayerList(nn.ModuleList):
    def __init__(self, blocks, rotary_emb):
        for block in blocks:
            block.set_rotary_emb(rotary_emb)
        super().__init__(blocks)

    @classmethod
    def from_layer(cls, layer, num_layers, rotary_emb):
        return cls([copy.deepcopy(layer) for _ in range(num_layers)], rotary_emb)


class RotaryTransformerFinalLayer(nn.Module):
    def __init__(self, d_model, out_dims, layer_norm_eps=1e-5, use_final_layer_norm=True, zero_init=False):
        super().__init__()
        self.norm_final = nn.LayerNorm(d_model, eps=layer_norm_eps) if use_final_layer_norm else None
        self.linear = nn.Linear(d_model, out_dims, bias=False)

    def forward(self, x):
        if self.norm_final is not None:
            x = self.norm_final(x)
        return self.linear(x)


# ------------------------------------------------------ xlm-models/mlm/model_mlm.py
class RotaryTransformerMLMModel(nn.Module):
    "Rotary embedding based transformer decoder."

    def __init__(self, num_embeddings, d_model, num_layers, nhead, padding_idx=0, mask_idx=1,
                 dim_feedforward=None, dropout=0.1, activation="relu", layer_norm_eps=1e-5,
                 rotary_emb_dim=64, max_length=1024, force_flash_attn=False,
                 use_flex_attn=False, final_layer_without_normalization=False):
        super().__init__()
        self.padding_idx = padding_idx
        self.mask_idx = mask_idx
        self.use_flex_attn = use_flex_attn
        self.embed_tokens = nn.Embedding(num_embeddings, d_model, padding_idx=padding_idx)
        self.dim_feedforward = dim_feedforward or 4 * d_model
        encoder_layer = RotaryTransformerLayer(
            d_model, nhead, self.dim_feedforward, dropout, activation, layer_norm_eps,
            force_flash_attn=force_flash_attn,
        )
        self.max_length = max_length
        self.encoder = RotaryTransformerLayerList.from_layer(
            encoder_layer, num_layers,
            RotaryEmbedding(rotary_emb_dim, head_first=True, cache_size=max_length),
        )
        self.output_layer = RotaryTransformerFinalLayer(
            d_model, num_embeddings, layer_norm_eps,
            use_final_layer_norm=not final_layer_without_normalization,
        )

    def forward(self, x_t, attention_mask=None, positions=None, block_mask=None):
        if attention_mask is not None:
            attention_mask = attention_mask.to(torch.bool)
        x = self.embed_tokens(x_t)
        if block_mask is not None:
            attention_mask = None
        for block in self.encoder:
            x = block(x, attention_mask, positions=positions, block_mask=block_mask)
        return self.output_layer(x)


# ------------------------------------------------------- xlm-models/mlm/loss_mlm.py
class MLMLoss:
    def __init__(self, loss_on_padding=False, loss_on_visible_tokens=False, model=None,
                 tokenizer=None, use_num_masked_factor=False):
        self.loss_on_padding = loss_on_padding
        self.loss_on_visible_tokens = loss_on_visible_tokens
        self.model = model
        self.tokenizer = tokenizer
        self.mask_token_id_tensor = None
        self.use_num_masked_factor = use_num_masked_factor
        self.flash_attn = None

    def configure(self, device):
        self.mask_token_id_tensor = torch.tensor(self.tokenizer.mask_token_id, dtype=torch.long, device=device)

    def __call__(self, batch):
        return self.loss_fn(batch)

    def loss_fn(self, batch):
        if self.flash_attn is None:
            self.flash_attn = getattr(self.model, "force_flash_attn", False)
        input_ids = batch["input_ids"]
        targets = batch["target_ids"]
        model = self.model
        attention_mask = batch["attention_mask"].to(dtype=torch.bool)
        positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        positions *= attention_mask  # technically not needed
        logits = model(input_ids, attention_mask if not self.flash_attn else None, positions)

        ignore = torch.zeros_like(input_ids, dtype=torch.bool)
        if not self.loss_on_visible_tokens:
            ignore = ignore.logical_or(input_ids != self.mask_token_id_tensor)
        targets[ignore] = -100
        logits_T = logits.transpose(1, 2)
        ce = F.cross_entropy(logits_T, targets, reduction="none", ignore_index=-100)
        if self.use_num_masked_factor:
            num_masked = (input_ids == self.mask_token_id_tensor).sum(dim=-1)
            ce = ce * (1 / (num_masked + 1))
        ce = masked_mean(ce.flatten(), ~ignore.flatten(), dim=-1)
        return {"loss": ce, "logits": logits}


# ------------------------------------------------------------------ stand-ins
class Tokenizer:
    pad_token_id = 0
    mask_token_id = 1
    bos_token_id = 2
    eos_token_id = 3
    vocab_size = 32


def main():
    torch.manual_seed(0)
    tok = Tokenizer()
    # configs/collator/seq2seq_mlm.yaml (STAR): add_bos false, add_eos true, truncate block,
    # loss_on_padding true; input_block_size / block_size from the experiment config.
    collator = MLMSeq2SeqTrainCollator(
        tokenizer=tok, noise_schedule=None, block_size=6, input_block_size=8,
        add_bos=False, add_eos=True, truncate="block", loss_on_padding=True,
    )
    examples = [
        {"prompt_ids": [11, 12, 13], "target_ids": [20, 21, 22, 23]},
        {"prompt_ids": [14, 15, 16, 17, 18, 19, 11], "target_ids": [24, 25, 26, 27, 28]},
    ]
    model = RotaryTransformerMLMModel(
        num_embeddings=tok.vocab_size, d_model=32, num_layers=2, nhead=4,
        padding_idx=tok.pad_token_id, mask_idx=tok.mask_token_id, dropout=0.0,
        rotary_emb_dim=8, max_length=64,
    )
    loss_fn = MLMLoss(model=model, tokenizer=tok)
    loss_fn.configure("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for step in range(3):
        batch = collator(examples)
        out = loss_fn(batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        print(f"step {step} loss {out['loss'].item():.6f}")
    print("input_ids", batch["input_ids"].tolist())
    print("attention_mask", batch["attention_mask"].int().tolist())


if __name__ == "__main__":
    main()
