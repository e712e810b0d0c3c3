# Citation: oarriaga/paz PR #422 ("Let the Florence-2 encoder skip padded instruction
#   tokens"; the same change was first proposed in oarriaga/paz#421). Source read at
#   commit 09eadf5 (after the fix): paz/models/foundation/florence2/model.py (build,
#   build_padding_mask, add_positions), florence2/encoder.py (build_encoder,
#   encoder_block), paz/models/transformers/attention.py (masked_attend, attend_key,
#   compute_scores, expand_mask_for_heads, mask_scores, apply_attention).
# Upstream is Keras 3; this is a torch port with the same names and flow. The DaViT
#   image encoder is replaced by a tiny patch-embedding stand-in that also yields 17
#   tokens per view (it has no mask of its own).
# Bug: Florence2 `build` handed `None` as the mask to `build_encoder`, although
#   `masked_attend` supports one, so in a batch whose instructions are padded to a
#   common length, every image and text token attends to the pad tokens in all BART
#   encoder layers.
# Fix: `build(..., pad_id=...)` derives a key padding mask from the token ids
#   (`build_padding_mask`: image tokens always valid, text valid where id != pad_id)
#   and passes it to `build_encoder`; batched callers pass pad_id.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- paz/models/transformers/attention.py -------------------------------------
def transpose_to_heads(projection):
    return projection.permute(0, 2, 1, 3)


def compute_scores(query, key, key_dim):
    scale = torch.sqrt(torch.tensor(float(key_dim), dtype=query.dtype))
    query = query / scale
    key = key.permute(0, 1, 3, 2)
    return torch.matmul(query, key)


def expand_mask_for_heads(mask):
    if mask is None:
        return None
    mask = mask.bool()
    if mask.dim() == 2:
        mask = mask[:, None, None, :]
    elif mask.dim() == 3:
        mask = mask[:, None]
    return mask


def mask_scores(scores, mask):
    if mask is None:
        return scores
    neg = torch.tensor(-1e9, dtype=scores.dtype)
    return torch.where(mask, scores, neg)


def apply_attention(scores, values, dropout):
    probs = torch.softmax(scores, dim=-1)
    probs = F.dropout(probs, dropout, training=False)
    return torch.matmul(probs, values)


def merge_heads(tensor):
    return tensor.permute(0, 2, 1, 3)


class MaskedAttend(nn.Module):
    """masked_attend(query, value, mask, num_heads, key_dim, dropout, name)."""

    def __init__(self, dim, num_heads, key_dim):
        super().__init__()
        self.num_heads, self.key_dim = num_heads, key_dim
        self.query = nn.Linear(dim, num_heads * key_dim)
        self.key = nn.Linear(dim, num_heads * key_dim)  # project_biased_key
        self.value = nn.Linear(dim, num_heads * key_dim)
        self.attention_output = nn.Linear(num_heads * key_dim, dim)

    def forward(self, query, value, mask, dropout=0.0):
        B, Lq, _ = query.shape
        Lk = value.shape[1]
        key = self.key(value).view(B, Lk, self.num_heads, self.key_dim)
        q = transpose_to_heads(self.query(query).view(B, Lq, self.num_heads, self.key_dim))
        k = transpose_to_heads(key)
        v = transpose_to_heads(self.value(value).view(B, Lk, self.num_heads, self.key_dim))
        scores = compute_scores(q, k, self.key_dim)
        scores = mask_scores(scores, expand_mask_for_heads(mask))
        output = apply_attention(scores, v, dropout)
        output = merge_heads(output).reshape(B, Lq, self.num_heads * self.key_dim)
        return self.attention_output(output)


# ---- paz/models/foundation/florence2/encoder.py --------------------------------
class EncoderBlock(nn.Module):
    def __init__(self, dim, num_heads, ffn_dim):
        super().__init__()
        self.self_attention = MaskedAttend(dim, num_heads, dim // num_heads)
        self.self_attention_norm = nn.LayerNorm(dim, eps=1e-5)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.final_norm = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, x, mask):
        delta = self.self_attention(x, x, mask, 0.0)
        x = self.self_attention_norm(x + delta)
        delta = self.fc2(F.gelu(self.fc1(x)))  # feedforward.gelu
        return self.final_norm(x + delta)


class Encoder(nn.Module):
    def __init__(self, num_layers, dim, num_heads, ffn_dim):
        super().__init__()
        self.layers = nn.ModuleList(EncoderBlock(dim, num_heads, ffn_dim) for _ in range(num_layers))

    def forward(self, x, mask):  # build_encoder(x, mask, num_layers, num_heads, ffn_dim)
        for block in self.layers:
            x = block(x, mask)
        return x


# ---- stand-in for florence2/vision.py ImageEncoder (DaViT): 17 tokens per view ----
class ImageEncoder(nn.Module):
    def __init__(self, image_size, hidden_dim):
        super().__init__()
        patch = image_size // 4
        self.patch_embed = nn.Conv2d(3, hidden_dim, patch, stride=patch)
        self.norm = nn.LayerNorm(hidden_dim)

    def forward(self, images):  # (B, H, W, 3), channels last as in Keras
        x = self.patch_embed(images.permute(0, 3, 1, 2)).flatten(2).transpose(1, 2)  # 16 tokens
        x = torch.cat([x.mean(dim=1, keepdim=True), x], dim=1)  # 17 tokens
        return self.norm(x)


# ---- paz/models/foundation/florence2/model.py ------------------------------------
def build_padding_mask(token_ids, num_image, pad_id):
    if pad_id is None:
        return None
    # Every image token is real, so only the instruction can be padded.
    text = token_ids != pad_id
    valid = torch.ones_like(text[:, :1])
    images = valid.repeat(1, num_image)
    return torch.cat([images, text], dim=1)


def build_shifted_positions(offset):
    return lambda x: torch.arange(x.shape[-2], dtype=torch.long) + offset


class Florence2Flower(nn.Module):
    def __init__(self, image_size=16, vocabulary_size=64, hidden_dim=32, num_layers=2,
                 num_heads=4, ffn_dim=64, max_positions=128, position_offset=2, pad_id=None):
        super().__init__()
        self.pad_id = pad_id
        self.position_offset = position_offset
        self.image_encoder = ImageEncoder(image_size, hidden_dim)
        self.embed_tokens = nn.Embedding(vocabulary_size, hidden_dim)
        self.embed_positions = nn.Embedding(max_positions, hidden_dim)
        self.layernorm_embedding = nn.LayerNorm(hidden_dim, eps=1e-5)
        self.encoder = Encoder(num_layers, hidden_dim, num_heads, ffn_dim)

    def add_positions(self, x):
        positions = build_shifted_positions(self.position_offset)(x)
        return x + self.embed_positions(positions)[None]

    def forward(self, static_images, wrist_images, token_ids):
        static_tokens = self.image_encoder(static_images)
        wrist_tokens = self.image_encoder(wrist_images)
        text_tokens = self.embed_tokens(token_ids)
        context = torch.cat((static_tokens, wrist_tokens, text_tokens), dim=1)
        num_image = static_tokens.shape[1] + wrist_tokens.shape[1]
        if FIXED:
            mask = build_padding_mask(token_ids, num_image, self.pad_id)
        else:
            mask = None
        x = self.add_positions(context)
        return self.encoder(self.layernorm_embedding(x), mask)


PAD_ID = 1  # BART <pad>
FLOW_ID = 5  # leading <Flow> prompt token
model = Florence2Flower(pad_id=PAD_ID).eval()

# A batch of two robot steps: instructions of 7 and 3 tokens, right-padded to 7.
instructions = [[FLOW_ID, 17, 23, 42, 8, 31, 2], [FLOW_ID, 44, 2]]
max_len = max(len(t) for t in instructions)
token_ids = torch.full((len(instructions), max_len), PAD_ID, dtype=torch.long)
for i, t in enumerate(instructions):
    token_ids[i, : len(t)] = torch.tensor(t)
static_images = torch.rand(2, 16, 16, 3)
wrist_images = torch.rand(2, 16, 16, 3)

with torch.no_grad():
    context_tokens = model(static_images, wrist_images, token_ids)
    # the short instruction encoded on its own, no padding
    alone = model(static_images[1:], wrist_images[1:], token_ids[1:, :3])

num_image = 34
print("context_tokens shape:", tuple(context_tokens.shape))
print("sample 1 image-token feature[0] sum (batched):", round(context_tokens[1, :num_image, 0].sum().item(), 6))
print("sample 1 image-token feature[0] sum (alone):  ", round(alone[0, :num_image, 0].sum().item(), 6))
print("sample 1 real tokens max |batched - alone|:",
      round((context_tokens[1, : num_image + 3] - alone[0]).abs().max().item(), 6))
print("sample 0 pooled context norm:", round(context_tokens[0].mean(dim=0).norm().item(), 6))
