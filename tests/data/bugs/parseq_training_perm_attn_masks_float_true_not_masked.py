# parseq (baudm/parseq commit 056c792, "Fix training on PyTorch 2+", fixing regression 970f266): PARSeq.generate_attn_masks
# fills a float zeros mask with True, so masked keys get an additive +1.0 instead of being blocked: the permutation
# language-modeling masks in training_step let every query see the characters it is asked to predict.
import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import transformer

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class DecoderLayer(nn.Module):
    """A Transformer decoder layer supporting two-stream attention (XLNet), pre-LN."""

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation='gelu', layer_norm_eps=1e-5):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm_q = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm_c = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.activation = transformer._get_activation_fn(activation)

    def forward_stream(self, tgt, tgt_norm, tgt_kv, memory, tgt_mask: Optional[Tensor], tgt_key_padding_mask: Optional[Tensor]):
        tgt2, sa_weights = self.self_attn(tgt_norm, tgt_kv, tgt_kv, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)
        tgt = tgt + self.dropout1(tgt2)
        tgt2, ca_weights = self.cross_attn(self.norm1(tgt), memory, memory)
        tgt = tgt + self.dropout2(tgt2)
        tgt2 = self.linear2(self.dropout(self.activation(self.linear1(self.norm2(tgt)))))
        tgt = tgt + self.dropout3(tgt2)
        return tgt, sa_weights, ca_weights

    def forward(self, query, content, memory, query_mask=None, content_mask=None, content_key_padding_mask=None, update_content=True):
        query_norm = self.norm_q(query)
        content_norm = self.norm_c(content)
        query = self.forward_stream(query, query_norm, content_norm, memory, query_mask, content_key_padding_mask)[0]
        if update_content:
            content = self.forward_stream(content, content_norm, content_norm, memory, content_mask, content_key_padding_mask)[0]
        return query, content


class Decoder(nn.Module):
    def __init__(self, decoder_layer, num_layers, norm):
        super().__init__()
        self.layers = transformer._get_clones(decoder_layer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, query, content, memory, query_mask=None, content_mask=None, content_key_padding_mask=None):
        for i, mod in enumerate(self.layers):
            last = i == len(self.layers) - 1
            query, content = mod(query, content, memory, query_mask, content_mask, content_key_padding_mask, update_content=not last)
        return self.norm(query)


class TokenEmbedding(nn.Module):
    def __init__(self, charset_size, embed_dim):
        super().__init__()
        self.embedding = nn.Embedding(charset_size, embed_dim)
        self.embed_dim = embed_dim

    def forward(self, tokens):
        return math.sqrt(self.embed_dim) * self.embedding(tokens)


class PARSeqModel(nn.Module):
    def __init__(self, num_tokens, max_label_length, embed_dim, dec_num_heads, dec_mlp_ratio, dec_depth, dropout):
        super().__init__()
        self.max_label_length = max_label_length
        # ViT encoder replaced by a patch projection of a random "image" (the bug is in the decoder masks)
        self.encoder = nn.Linear(48, embed_dim)
        decoder_layer = DecoderLayer(embed_dim, dec_num_heads, embed_dim * dec_mlp_ratio, dropout)
        self.decoder = Decoder(decoder_layer, num_layers=dec_depth, norm=nn.LayerNorm(embed_dim))
        self.head = nn.Linear(embed_dim, num_tokens - 2)
        self.text_embed = TokenEmbedding(num_tokens, embed_dim)
        self.pos_queries = nn.Parameter(torch.randn(1, max_label_length + 1, embed_dim) * 0.02)
        self.dropout = nn.Dropout(p=dropout)

    def encode(self, img):
        return self.encoder(img)

    def decode(self, tgt, memory, tgt_mask=None, tgt_padding_mask=None, tgt_query=None, tgt_query_mask=None):
        N, L = tgt.shape
        null_ctx = self.text_embed(tgt[:, :1])
        tgt_emb = self.pos_queries[:, : L - 1] + self.text_embed(tgt[:, 1:])
        tgt_emb = self.dropout(torch.cat([null_ctx, tgt_emb], dim=1))
        if tgt_query is None:
            tgt_query = self.pos_queries[:, :L].expand(N, -1, -1)
        tgt_query = self.dropout(tgt_query)
        return self.decoder(tgt_query, tgt_emb, memory, tgt_query_mask, tgt_mask, tgt_padding_mask)


class PARSeq(nn.Module):
    """Trimmed strhub.models.parseq.system.PARSeq: gen_tgt_perms (forward + mirrored only), generate_attn_masks, training_step."""

    def __init__(self):
        super().__init__()
        self.charset = "abcdefghij"
        self.eos_id, self.bos_id, self.pad_id = 0, len(self.charset) + 1, len(self.charset) + 2
        num_tokens = len(self.charset) + 3
        self.model = PARSeqModel(num_tokens, max_label_length=8, embed_dim=32, dec_num_heads=4, dec_mlp_ratio=2, dec_depth=1, dropout=0.0)

    @property
    def _device(self):
        return self.model.head.weight.device

    def encode_labels(self, labels):
        batch = [torch.as_tensor([self.bos_id] + [self.charset.index(c) + 1 for c in y] + [self.eos_id]) for y in labels]
        return nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=self.pad_id)

    def gen_tgt_perms(self, tgt):
        max_num_chars = tgt.shape[1] - 2
        perms = torch.arange(max_num_chars, device=self._device).unsqueeze(0)
        comp = perms.flip(-1)
        perms = torch.stack([perms, comp]).transpose(0, 1).reshape(-1, max_num_chars)
        bos_idx = perms.new_zeros((len(perms), 1))
        eos_idx = perms.new_full((len(perms), 1), max_num_chars + 1)
        perms = torch.cat([bos_idx, perms + 1, eos_idx], dim=1)
        if len(perms) > 1:
            perms[1, 1:] = max_num_chars + 1 - torch.arange(max_num_chars + 1, device=self._device)
        return perms

    def generate_attn_masks(self, perm):
        """Generate attention masks given a sequence permutation (includes pos. for bos and eos tokens)"""
        sz = perm.shape[0]
        if FIXED:
            mask = torch.zeros((sz, sz), dtype=torch.bool, device=self._device)
        else:
            mask = torch.zeros((sz, sz), device=self._device)
        for i in range(sz):
            query_idx = perm[i]
            masked_keys = perm[i + 1 :]
            mask[query_idx, masked_keys] = True
        content_mask = mask[:-1, :-1].clone()
        mask[torch.eye(sz, dtype=torch.bool, device=self._device)] = True  # mask "self"
        query_mask = mask[1:, :-1]
        return content_mask, query_mask

    def training_step(self, images, labels, return_logits=False):
        tgt = self.encode_labels(labels)
        memory = self.model.encode(images)
        tgt_perms = self.gen_tgt_perms(tgt)
        tgt_in = tgt[:, :-1]
        tgt_out = tgt[:, 1:]
        tgt_padding_mask = (tgt_in == self.pad_id) | (tgt_in == self.eos_id)
        loss = 0
        loss_numel = 0
        all_logits = []
        n = (tgt_out != self.pad_id).sum().item()
        for i, perm in enumerate(tgt_perms):
            tgt_mask, query_mask = self.generate_attn_masks(perm)
            out = self.model.decode(tgt_in, memory, tgt_mask, tgt_padding_mask, tgt_query_mask=query_mask)
            logits = self.model.head(out)
            all_logits.append(logits)
            loss += n * F.cross_entropy(logits.flatten(end_dim=1), tgt_out.flatten(), ignore_index=self.pad_id)
            loss_numel += n
            if i == 1:
                tgt_out = torch.where(tgt_out == self.eos_id, self.pad_id, tgt_out)
                n = (tgt_out != self.pad_id).sum().item()
        loss /= loss_numel
        return (loss, all_logits, tgt_in, memory, tgt_padding_mask) if return_logits else loss


system = PARSeq().eval()
images = torch.randn(2, 12, 48)  # (N, patches, patch_dim)
labels = ["abcde", "jihgf"]

with torch.no_grad():
    loss, all_logits, tgt_in, memory, tgt_padding_mask = system.training_step(images, labels, return_logits=True)
    # Reference: the model's own forward-permutation special case (boolean triu mask, as in PARSeq.forward)
    num_steps = tgt_in.shape[1]
    tgt_mask = query_mask = torch.triu(torch.full((num_steps, num_steps), True), 1)
    ref = system.model.head(system.model.decode(tgt_in, memory, tgt_mask, tgt_padding_mask, tgt_query_mask=query_mask))

print(f"training loss: {loss.item():.4f}")
print(f"max |canonical-perm training logits - causal reference logits|: {(all_logits[0] - ref).abs().max().item():.3e}")
