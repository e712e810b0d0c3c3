"""nanoVLM: a SigLIP-style ViT encodes each image, the modality projector pixel-shuffles its
patches into mp_image_token_length embeddings that replace the <|image|> placeholders, and a
Llama-style decoder (GQA, RoPE from start_pos, its own dict KV cache) reads the merged sequence.
The VQA collator left-pads input_ids / attention_mask (labels with -100); the lmms-eval wrapper
left-pads batched prompts and hands the attention_mask to VisionLanguageModel.generate, which
appends a 1 per decode step.

Ported from huggingface/nanoVLM @4e0c0961846135c2217f95e54cb4c2d66eb55e42:
  models/vision_transformer.py   ViTPatchEmbeddings, ViTMultiHeadAttention, ViTMLP, ViTBlock, ViT
  models/modality_projector.py   ModalityProjector (pixel_shuffle, proj)
  models/language_model.py       RMSNorm, RotaryEmbedding, rotate_half, apply_rotary_pos_embd,
                                 LanguageModelGroupedQueryAttention (additive key padding mask
                                 + is_causal / tril), LanguageModelMLP, LanguageModelBlock,
                                 LanguageModel.forward
  models/vision_language_model.py  _replace_img_tokens_with_embd, forward, generate (greedy path)
  models/config.py               VLMConfig (sizes shrunk)
  data/collators.py              VQACollator._pad_batch (left padding)
  data/datasets.py               VQADataset._get_labels (labels rolled by one, -100 elsewhere)
  data/processors.py             get_image_string (global image token + image tokens)
  eval/lmms_eval_wrapper.py      batched prompts, padding="longest", padding_side="left"
The Hugging Face tokenizer is replaced by a word-level stand-in; float64 throughout.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


@dataclass
class VLMConfig:
    vit_hidden_dim: int = 32
    vit_inter_dim: int = 64
    vit_patch_size: int = 4
    vit_img_size: int = 16
    vit_n_heads: int = 4
    vit_dropout: float = 0.0
    vit_n_blocks: int = 2
    vit_ln_eps: float = 1e-6
    vit_cls_flag: bool = False

    lm_hidden_dim: int = 32
    lm_inter_dim: int = 64
    lm_rms_eps: float = 1e-5
    lm_re_base: int = 100000
    lm_max_position_embeddings: int = 8192
    lm_vocab_size: int = 48
    lm_n_heads: int = 4
    lm_n_kv_heads: int = 2
    lm_dropout: float = 0.0
    lm_n_blocks: int = 2
    lm_attn_scaling: float = 1.0
    lm_use_tokens: bool = False
    lm_tie_weights: bool = True

    mp_pixel_shuffle_factor: int = 2
    mp_image_token_length: int = 4


# --------------------------------------------------------------------------- tokenizer stand-in
class WordTokenizer:
    def __init__(self):
        words = ("<|pad|> <|endoftext|> <|im_start|> <|im_end|> <|image|> <|global_image|> user "
                 "assistant what is in the picture a red cat dog on mat how many birds two three "
                 "sky blue colour of describe it tree green small big").split()
        self.vocab = {w: i for i, w in enumerate(words)}
        self.pad_token_id = self.vocab["<|pad|>"]
        self.eos_token_id = self.vocab["<|endoftext|>"]
        self.image_token = "<|image|>"
        self.global_image_token = "<|global_image|>"
        self.image_token_id = self.vocab[self.image_token]

    def encode(self, text):
        return [self.vocab[w] for w in text.split()]

    def __call__(self, prompts, padding_side="left"):
        ids = [self.encode(p) for p in prompts]
        L = max(map(len, ids))
        input_ids, attention_mask = [], []
        for x in ids:
            pad = [self.pad_token_id] * (L - len(x))
            input_ids.append(pad + x if padding_side == "left" else x + pad)
            m = [0] * (L - len(x))
            attention_mask.append(m + [1] * len(x) if padding_side == "left" else [1] * len(x) + m)
        return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask)}


def get_image_string(tokenizer, splitted_image_counts, mp_image_token_length):
    image_string = ""
    for idx, (n_h, n_w) in enumerate(splitted_image_counts):
        if hasattr(tokenizer, "global_image_token"):
            image_string += tokenizer.global_image_token + " "
            image_string += (tokenizer.image_token + " ") * mp_image_token_length
            if n_h == 1 and n_w == 1:
                continue
    return image_string


# --------------------------------------------------------------------------- vision_transformer.py
class ViTPatchEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.img_size = cfg.vit_img_size
        self.patch_size = cfg.vit_patch_size
        self.num_patches = (self.img_size // self.patch_size) ** 2
        self.cls_flag = cfg.vit_cls_flag
        self.embd_dim = cfg.vit_hidden_dim
        self.conv = nn.Conv2d(3, self.embd_dim, kernel_size=self.patch_size, stride=self.patch_size,
                              padding="valid")
        self.position_embedding = nn.Parameter(torch.rand(1, self.num_patches, self.embd_dim))

    def forward(self, x):
        x = self.conv(x)
        x = x.flatten(2)
        x = x.transpose(1, 2)
        x = x + self.position_embedding
        return x


class ViTMultiHeadAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.vit_n_heads
        self.embd_dim = cfg.vit_hidden_dim
        self.head_dim = self.embd_dim // self.n_heads
        self.dropout = cfg.vit_dropout
        self.qkv_proj = nn.Linear(self.embd_dim, 3 * self.embd_dim, bias=True)
        self.out_proj = nn.Linear(self.embd_dim, self.embd_dim, bias=True)
        self.attn_dropout = nn.Dropout(self.dropout)
        self.resid_dropout = nn.Dropout(self.dropout)
        self.sdpa = hasattr(torch.nn.functional, 'scaled_dot_product_attention')

    def forward(self, x):
        B, T, C = x.size()
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        if self.sdpa:
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0,
                is_causal=False)  # ViT attention is bidirectional
        else:
            attn = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            attn = F.softmax(attn, dim=-1)
            attn = self.attn_dropout(attn)
            y = attn @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.out_proj(y)
        y = self.resid_dropout(y)
        return y


class ViTMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.activation_fn = nn.GELU(approximate='tanh')
        self.fc1 = nn.Linear(cfg.vit_hidden_dim, cfg.vit_inter_dim)
        self.fc2 = nn.Linear(cfg.vit_inter_dim, cfg.vit_hidden_dim)
        self.dropout = nn.Dropout(cfg.vit_dropout)

    def forward(self, x):
        return self.dropout(self.fc2(self.activation_fn(self.fc1(x))))


class ViTBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.vit_hidden_dim, eps=cfg.vit_ln_eps)
        self.attn = ViTMultiHeadAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.vit_hidden_dim, eps=cfg.vit_ln_eps)
        self.mlp = ViTMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class ViT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = ViTPatchEmbeddings(cfg)
        self.cls_flag = cfg.vit_cls_flag
        self.dropout = nn.Dropout(cfg.vit_dropout)
        self.blocks = nn.ModuleList([ViTBlock(cfg) for _ in range(cfg.vit_n_blocks)])
        self.layer_norm = nn.LayerNorm(cfg.vit_hidden_dim, eps=cfg.vit_ln_eps)

    def forward(self, x):
        x = self.patch_embedding(x)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        x = self.layer_norm(x)
        return x


# --------------------------------------------------------------------------- modality_projector.py
class ModalityProjector(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.input_dim = cfg.vit_hidden_dim * (cfg.mp_pixel_shuffle_factor ** 2)
        self.output_dim = cfg.lm_hidden_dim
        self.scale_factor = cfg.mp_pixel_shuffle_factor
        self.proj = nn.Linear(self.input_dim, self.output_dim, bias=False)

    def pixel_shuffle(self, x):
        bsz, seq, embed_dim = x.size()
        seq_root = int(seq ** 0.5)
        assert seq_root ** 2 == seq
        assert seq_root % self.scale_factor == 0
        height = width = seq_root
        x = x.view(bsz, height, width, embed_dim)
        h_out = height // self.scale_factor
        w_out = width // self.scale_factor
        x = x.reshape(bsz, h_out, self.scale_factor, w_out, self.scale_factor, embed_dim)
        x = x.permute(0, 1, 3, 2, 4, 5).contiguous()
        x = x.reshape(bsz, h_out * w_out, embed_dim * self.scale_factor ** 2)
        return x

    def forward(self, x):
        x = self.pixel_shuffle(x)
        x = self.proj(x)
        return x


# --------------------------------------------------------------------------- language_model.py
class RMSNorm(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(cfg.lm_hidden_dim))
        self.eps = cfg.lm_rms_eps

    def forward(self, x):
        irms = torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + self.eps)
        return x * irms * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dim = cfg.lm_hidden_dim // cfg.lm_n_heads
        self.base = cfg.lm_re_base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).double() / self.dim))
        self.register_buffer("inv_freq", inv_freq)
        self.original_max_seq_len = cfg.lm_max_position_embeddings
        self.attention_scaling = cfg.lm_attn_scaling

    @torch.no_grad()
    def forward(self, position_ids):
        batch_size, seq_len = position_ids.shape
        max_seq = position_ids.max() + 1
        if max_seq > self.original_max_seq_len:
            inv_freq = self.inv_freq / (max_seq / self.original_max_seq_len)
        else:
            inv_freq = self.inv_freq
        flat_position_ids = position_ids.reshape(-1).double()
        freqs = flat_position_ids.unsqueeze(-1) * inv_freq.unsqueeze(0)
        freqs = freqs.reshape(batch_size, seq_len, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return torch.cos(emb) * self.attention_scaling, torch.sin(emb) * self.attention_scaling


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_embd(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class LanguageModelGroupedQueryAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.lm_n_heads
        self.n_kv_heads = cfg.lm_n_kv_heads
        self.embd_dim = cfg.lm_hidden_dim
        self.dropout = cfg.lm_dropout
        self.n_kv_groups = self.n_heads // self.n_kv_heads
        self.head_dim = self.embd_dim // self.n_heads
        self.q_proj = nn.Linear(self.embd_dim, self.embd_dim, bias=False)
        self.k_proj = nn.Linear(self.embd_dim, self.head_dim * self.n_kv_heads, bias=False)
        self.v_proj = nn.Linear(self.embd_dim, self.head_dim * self.n_kv_heads, bias=False)
        self.out_proj = nn.Linear(self.embd_dim, self.embd_dim, bias=False)
        self.attn_dropout = nn.Dropout(self.dropout)
        self.resid_dropout = nn.Dropout(self.dropout)
        self.sdpa = hasattr(torch.nn.functional, 'scaled_dot_product_attention')

    def forward(self, x, cos, sin, attention_mask=None, block_kv_cache=None):
        is_prefill = block_kv_cache is None
        B, T_curr, C = x.size()
        q_curr = self.q_proj(x).view(B, T_curr, self.n_heads, self.head_dim).transpose(1, 2)
        k_curr = self.k_proj(x).view(B, T_curr, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_curr = self.v_proj(x).view(B, T_curr, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k_rotated = apply_rotary_pos_embd(q_curr, k_curr, cos, sin)

        if not is_prefill and block_kv_cache['key'] is not None:
            k = block_kv_cache['key']
            v = block_kv_cache['value']
            k = torch.cat([k, k_rotated], dim=2)
            v = torch.cat([v, v_curr], dim=2)
            block_kv_cache['key'] = k
            block_kv_cache['value'] = v
        else:
            k = k_rotated
            v = v_curr
            block_kv_cache = {'key': k, 'value': v}

        k_exp = k.repeat_interleave(self.n_kv_groups, dim=1)
        v_exp = v.repeat_interleave(self.n_kv_groups, dim=1)
        T_kv = k_exp.size(2)

        # attention_mask is (B, T_kv_total_length), 1 for attend, 0 for pad
        additive_attn_mask = None
        if attention_mask is not None:
            mask_for_keys = attention_mask[:, :T_kv]
            additive_attn_mask = (1.0 - mask_for_keys.unsqueeze(1).unsqueeze(2).to(q.dtype)) * torch.finfo(q.dtype).min

        if self.sdpa and x.device.type != 'mps':
            # During decode, no additional masking needed as [1, T_kv] is naturally causal
            is_causal = (T_curr == T_kv and T_curr > 1)
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k_exp, v_exp, attn_mask=additive_attn_mask,
                dropout_p=self.dropout if self.training else 0.0, is_causal=is_causal)
        else:
            attn = torch.matmul(q, k_exp.transpose(2, 3)) / math.sqrt(self.head_dim)
            if T_curr == T_kv and T_curr > 1:
                causal_mask_val = torch.tril(torch.ones(T_curr, T_curr, device=x.device, dtype=torch.bool)).view(1, 1, T_curr, T_curr)
                attn = attn.masked_fill(~causal_mask_val, float('-inf'))
            if additive_attn_mask is not None:
                attn = attn + additive_attn_mask
            attn = F.softmax(attn, dim=-1)
            attn = self.attn_dropout(attn)
            y = attn @ v_exp

        y = y.transpose(1, 2).contiguous().view(B, T_curr, C)
        y = self.out_proj(y)
        y = self.resid_dropout(y)
        return y, block_kv_cache


class LanguageModelMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.activation_fn = F.silu
        self.gate_proj = nn.Linear(cfg.lm_hidden_dim, cfg.lm_inter_dim, bias=False)
        self.up_proj = nn.Linear(cfg.lm_hidden_dim, cfg.lm_inter_dim, bias=False)
        self.down_proj = nn.Linear(cfg.lm_inter_dim, cfg.lm_hidden_dim, bias=False)

    def forward(self, x):
        gate = self.activation_fn(self.gate_proj(x))
        return self.down_proj(gate * self.up_proj(x))


class LanguageModelBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.mlp = LanguageModelMLP(cfg)
        self.attn = LanguageModelGroupedQueryAttention(cfg)
        self.norm1 = RMSNorm(cfg)
        self.norm2 = RMSNorm(cfg)

    def forward(self, x, cos, sin, attention_mask=None, block_kv_cache=None):
        res = x
        x = self.norm1(x)
        x, block_kv_cache = self.attn(x, cos, sin, attention_mask, block_kv_cache)
        x = res + x
        res = x
        x = self.norm2(x)
        x = self.mlp(x)
        x = res + x
        return x, block_kv_cache


class LanguageModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.lm_use_tokens = cfg.lm_use_tokens
        self.lm_tie_weights = cfg.lm_tie_weights
        self.token_embedding = nn.Embedding(cfg.lm_vocab_size, cfg.lm_hidden_dim)
        self.rotary_embd = RotaryEmbedding(cfg)
        self.blocks = nn.ModuleList([LanguageModelBlock(cfg) for _ in range(cfg.lm_n_blocks)])
        self.norm = RMSNorm(cfg)
        self.head = nn.Linear(cfg.lm_hidden_dim, cfg.lm_vocab_size, bias=False)
        if self.lm_tie_weights:
            self.head.weight = self.token_embedding.weight

    def forward(self, x, attention_mask=None, kv_cache=None, start_pos=0):
        if self.lm_use_tokens:
            x = self.token_embedding(x)
        B, T_curr, _ = x.size()
        current_position_ids = torch.arange(start_pos, start_pos + T_curr, device=x.device).unsqueeze(0).expand(B, -1)
        cos, sin = self.rotary_embd(current_position_ids)
        if kv_cache is None:
            kv_cache = [None] * len(self.blocks)
        for i, block in enumerate(self.blocks):
            x, kv_cache[i] = block(x, cos, sin, attention_mask, kv_cache[i])
        x = self.norm(x)
        if self.lm_use_tokens:
            x = self.head(x)
        return x, kv_cache


# --------------------------------------------------------------------------- vision_language_model.py
class VisionLanguageModel(nn.Module):
    def __init__(self, cfg, tokenizer):
        super().__init__()
        self.cfg = cfg
        self.vision_encoder = ViT(cfg)
        self.decoder = LanguageModel(cfg)
        self.MP = ModalityProjector(cfg)
        self.tokenizer = tokenizer

    def _replace_img_tokens_with_embd(self, input_ids, token_embd, image_embd):
        updated_token_embd = token_embd.clone()
        mask = (input_ids == self.tokenizer.image_token_id)
        updated_token_embd[mask] = image_embd.view(-1, image_embd.size(-1)).to(updated_token_embd.dtype)
        return updated_token_embd

    def _process_images(self, images, device):
        if isinstance(images, list):
            if images and isinstance(images[0], list):
                images = [img for sublist in images for img in sublist]
            if not images:
                return None
            return torch.cat(images, dim=0).to(device)
        return images

    def forward(self, input_ids, images, attention_mask=None, targets=None):
        images_tensor = self._process_images(images, input_ids.device)
        token_embd = self.decoder.token_embedding(input_ids)
        if images_tensor is not None:
            image_embd = self.vision_encoder(images_tensor)
            image_embd = self.MP(image_embd)
            token_embd = self._replace_img_tokens_with_embd(input_ids, token_embd, image_embd)
        logits, _ = self.decoder(token_embd, attention_mask=attention_mask)
        loss = None
        if targets is not None:
            logits = self.decoder.head(logits)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100)
        return logits, loss

    @torch.inference_mode()
    def generate(self, input_ids, images, attention_mask=None, max_new_tokens=5, greedy=True):
        images_tensor = self._process_images(images, input_ids.device)
        token_embd = self.decoder.token_embedding(input_ids)
        if images_tensor is not None:
            image_embd = self.vision_encoder(images_tensor)
            image_embd = self.MP(image_embd)
            token_embd = self._replace_img_tokens_with_embd(input_ids, token_embd, image_embd)

        current_total_seq_len = token_embd.size(1)
        batch_size = input_ids.size(0)
        prefill_output, kv_cache_list = self.decoder(token_embd, attention_mask=attention_mask, kv_cache=None, start_pos=0)
        current_logits = self.decoder.head(prefill_output[:, -1, :])

        newly_generated_ids_list = []
        for _ in range(max_new_tokens):
            next_token_id = torch.argmax(current_logits, dim=-1, keepdim=True)
            newly_generated_ids_list.append(next_token_id)
            next_token_embed = self.decoder.token_embedding(next_token_id)
            current_token_start_pos = current_total_seq_len
            current_total_seq_len += 1
            if attention_mask is not None:
                attention_mask = torch.cat((attention_mask, torch.ones((batch_size, 1), device=attention_mask.device, dtype=attention_mask.dtype)), dim=1)
            decode_step_output, kv_cache_list = self.decoder(
                next_token_embed, attention_mask=attention_mask, kv_cache=kv_cache_list,
                start_pos=current_token_start_pos)
            current_logits = self.decoder.head(decode_step_output[:, -1, :])
        return torch.cat(newly_generated_ids_list, dim=1)


# --------------------------------------------------------------------------- data
def _get_labels(input_ids, mask):
    labels = input_ids.clone().masked_fill(~mask, -100)
    labels = labels.roll(-1)
    labels[-1] = -100
    return labels


class VQACollator:
    def __init__(self, tokenizer, max_length):
        self.tokenizer = tokenizer
        self.max_length = max_length

    def _pad_batch(self, batch, max_length):
        batch["input_ids"] = [torch.nn.functional.pad(ids, (max_length - len(ids), 0), value=self.tokenizer.pad_token_id) for ids in batch["input_ids"]]
        batch["labels"] = [torch.nn.functional.pad(labels, (max_length - len(labels), 0), value=-100) for labels in batch["labels"]]
        batch["attention_mask"] = [torch.nn.functional.pad(attention_mask, (max_length - len(attention_mask), 0), value=0) for attention_mask in batch["attention_mask"]]

    def __call__(self, batch):
        batch = {k: [item[k] for item in batch] for k in batch[0]}
        max_len = max(map(len, batch["input_ids"]))
        self._pad_batch(batch, max_len)
        return {
            "input_ids": torch.stack(batch["input_ids"]),
            "attention_mask": torch.stack(batch["attention_mask"]),
            "images": batch["images"],
            "labels": torch.stack(batch["labels"]),
        }


cfg = VLMConfig()
tok = WordTokenizer()
model = VisionLanguageModel(cfg, tok).eval()

qa = [("what is in the picture", "a red cat on the mat"),
      ("how many birds", "two"),
      ("describe it", "a small green tree in the blue sky"),
      ("what colour is the sky", "blue")]
images = [torch.randn(1, 3, cfg.vit_img_size, cfg.vit_img_size) for _ in qa]


def make_item(q, a, img):
    user = "<|im_start|> user " + get_image_string(tok, [(1, 1)], cfg.mp_image_token_length) + q + " <|im_end|> "
    asst = "<|im_start|> assistant " + a + " <|im_end|>"
    u, s = tok.encode(user), tok.encode(asst)
    ids = torch.tensor(u + s)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(u) + 2:] = True  # the assistant turn after its "<|im_start|> assistant" prefix
    return {"images": [img], "input_ids": ids, "attention_mask": torch.ones(len(ids), dtype=torch.long),
            "labels": _get_labels(ids, mask)}


items = [make_item(q, a, img) for (q, a), img in zip(qa, images)]
batch = VQACollator(tok, max_length=64)(items)
assert (batch["attention_mask"][:, 0] == 0).any()

worst = 0.0
for sdpa in (True, False):
    for m in model.modules():
        if hasattr(m, "sdpa"):
            m.sdpa = sdpa
    with torch.no_grad():
        logits, loss = model(batch["input_ids"], batch["images"], attention_mask=batch["attention_mask"],
                             targets=batch["labels"])
        # reference: each sample alone, no padding, no attention_mask; loss by a double loop
        total, count = 0.0, 0
        for b, it in enumerate(items):
            n = len(it["input_ids"])
            ref_logits, _ = model(it["input_ids"][None], [it["images"]], attention_mask=None, targets=None)
            ref_logits = model.decoder.head(ref_logits)[0]
            got = logits[b, -n:]
            worst = max(worst, (got - ref_logits).abs().max().item())
            for t in range(n):
                y = it["labels"][t].item()
                if y != -100:
                    total += -torch.log_softmax(ref_logits[t], -1)[y].item()
                    count += 1
        ref_loss = total / count
        worst = max(worst, abs(loss.item() - ref_loss))

    # batched evaluation prompts, left-padded as in the lmms-eval wrapper
    prompts = ["<|im_start|> user " + get_image_string(tok, [(1, 1)], cfg.mp_image_token_length) + q + " <|im_end|> <|im_start|> assistant"
               for q, _ in qa]
    inputs = tok(prompts, padding_side="left")
    step_logits = []
    hook = model.decoder.head.register_forward_hook(lambda mod, inp, outp: step_logits.append(outp))
    out = model.generate(inputs["input_ids"], images, inputs["attention_mask"], max_new_tokens=6, greedy=True)
    batched_steps = torch.stack(step_logits, 1)  # (B, steps, V)
    for b, p in enumerate(prompts):
        ids = torch.tensor([tok.encode(p)])
        step_logits.clear()
        ref = model.generate(ids, [images[b]], None, max_new_tokens=6, greedy=True)
        assert torch.equal(out[b], ref[0]), (sdpa, b, out[b], ref[0])
        worst = max(worst, (batched_steps[b] - torch.stack(step_logits, 1)[0]).abs().max().item())
        # the decode-step hidden states with the cache against a full recompute of prompt + generated
        with torch.no_grad():
            full_ids = torch.cat([ids, ref[:, :-1]], dim=1)
            emb = model.decoder.token_embedding(full_ids)
            img = model.MP(model.vision_encoder(images[b]))
            emb = model._replace_img_tokens_with_embd(full_ids, emb, img)
            h, _ = model.decoder(emb)
            assert torch.equal(model.decoder.head(h[0, ids.size(1) - 1:]).argmax(-1), ref[0])
    hook.remove()

print(f"max |batched - per-sample| (logits, loss, generate step logits) = {worst:.2e}")
assert worst < 1e-10, worst
print("ok")
