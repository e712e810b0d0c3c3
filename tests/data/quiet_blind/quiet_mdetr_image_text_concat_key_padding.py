"""MDETR (ashkamath/mdetr): image features and RoBERTa text features concatenated
into one sequence, with the image padding mask (NestedTensor, bottom/right padding,
True = pad) and the inverted HuggingFace text attention mask (right padding) joined
into a single key_padding_mask for the encoder; the decoder's object queries then
cross-attend over the padded joint memory with memory_key_padding_mask.

Port of models/transformer.py @8cbe208a8ee3a45bc3838dded76d522fcedf2542
(Transformer.forward encode_and_save / decode, TransformerEncoderLayer,
TransformerDecoderLayer with cross_attn_image, FeatureResizer),
models/position_encoding.py (PositionEmbeddingSine normalize=True, cumsum of ~mask),
models/backbone.py mask interpolation and util/misc.py NestedTensor.from_tensor_list,
models/mdetr.py MDETR.forward (two-stage memory_cache), at tiny sizes.
The text encoder is a tiny RobertaModel built from a config (no download), the
tokenizer is replaced by fixed ids (<s>=0, </s>=2, <pad>=1). The CNN backbone is a
stride-2 2x2 patch conv (no receptive field crossing the pad border).

Reference: each (image, caption) pair run alone, image cropped to its true size and
caption unpadded; decoder outputs and valid memory positions must match.
"""
import copy
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import RobertaConfig, RobertaModel


# ------------------------------------------------------------------ util/misc.py
class NestedTensor(object):
    def __init__(self, tensors, mask):
        self.tensors = tensors
        self.mask = mask

    def decompose(self):
        return self.tensors, self.mask

    @classmethod
    def from_tensor_list(cls, tensor_list):
        if tensor_list[0].ndim == 3:
            max_size = tuple(max(s) for s in zip(*[img.shape for img in tensor_list]))
            batch_shape = (len(tensor_list),) + max_size
            b, c, h, w = batch_shape
            dtype = tensor_list[0].dtype
            tensor = torch.zeros(batch_shape, dtype=dtype)
            mask = torch.ones((b, h, w), dtype=torch.bool)
            for img, pad_img, m in zip(tensor_list, tensor, mask):
                pad_img[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
                m[: img.shape[1], : img.shape[2]] = False
        else:
            raise ValueError("not supported")
        return cls(tensor, mask)


# ----------------------------------------------------------- position_encoding.py
class PositionEmbeddingSine(nn.Module):
    def __init__(self, num_pos_feats=64, temperature=10000, normalize=False, scale=None):
        super().__init__()
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.normalize = normalize
        if scale is None:
            scale = 2 * math.pi
        self.scale = scale

    def forward(self, tensor_list):
        x = tensor_list.tensors
        mask = tensor_list.mask
        not_mask = ~mask
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        if self.normalize:
            eps = 1e-6
            y_embed = y_embed / (y_embed[:, -1:, :] + eps) * self.scale
            x_embed = x_embed / (x_embed[:, :, -1:] + eps) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=x.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x = x_embed[:, :, :, None] / dim_t
        pos_y = y_embed[:, :, :, None] / dim_t
        pos_x = torch.stack((pos_x[:, :, :, 0::2].sin(), pos_x[:, :, :, 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[:, :, :, 0::2].sin(), pos_y[:, :, :, 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)


# ------------------------------------------------------------------- backbone.py
class Joiner(nn.Module):
    """BackboneBase + Joiner: features, interpolated mask, position embedding."""

    def __init__(self, num_channels, position_embedding):
        super().__init__()
        self.body = nn.Conv2d(3, num_channels, kernel_size=2, stride=2)
        self.num_channels = num_channels
        self.position_embedding = position_embedding

    def forward(self, tensor_list: NestedTensor):
        x = self.body(tensor_list.tensors)
        m = tensor_list.mask
        mask = F.interpolate(m[None].float(), size=x.shape[-2:]).to(torch.bool)[0]
        feat = NestedTensor(x, mask)
        return [feat], [self.position_embedding(feat).to(x.dtype)]


# ---------------------------------------------------------------- transformer.py
class Transformer(nn.Module):
    def __init__(self, text_encoder, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                 dim_feedforward=64, dropout=0.1, activation="relu", return_intermediate_dec=True,
                 pass_pos_and_query=True):
        super().__init__()
        self.pass_pos_and_query = pass_pos_and_query
        encoder_layer = TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, activation)
        self.encoder = TransformerEncoder(encoder_layer, num_encoder_layers, None)
        decoder_layer = TransformerDecoderLayer(d_model, nhead, dim_feedforward, dropout, activation)
        decoder_norm = nn.LayerNorm(d_model)
        self.decoder = TransformerDecoder(decoder_layer, num_decoder_layers, decoder_norm,
                                          return_intermediate=return_intermediate_dec)
        self.CLS = None
        self._reset_parameters()
        self.text_encoder = text_encoder
        config = self.text_encoder.config
        self.resizer = FeatureResizer(input_feat_size=config.hidden_size, output_feat_size=d_model, dropout=0.1)
        self.d_model = d_model
        self.nhead = nhead

    def _reset_parameters(self):
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src=None, mask=None, query_embed=None, pos_embed=None, text=None, encode_and_save=True,
                text_memory=None, img_memory=None, text_attention_mask=None):
        if encode_and_save:
            # flatten NxCxHxW to HWxNxC
            bs, c, h, w = src.shape
            src = src.flatten(2).permute(2, 0, 1)
            pos_embed = pos_embed.flatten(2).permute(2, 0, 1)
            query_embed = query_embed.unsqueeze(1).repeat(1, bs, 1)
            mask = mask.flatten(1)
            tgt = torch.zeros_like(query_embed)

            # Encode the text (tokenized = {"input_ids", "attention_mask"}, padding="longest")
            tokenized = text
            encoded_text = self.text_encoder(**tokenized)
            # Transpose memory because pytorch's attention expects sequence first
            text_memory = encoded_text.last_hidden_state.transpose(0, 1)
            # Invert attention mask that we get from huggingface because its the opposite in pytorch transformer
            text_attention_mask = tokenized["attention_mask"].ne(1).bool()
            text_memory_resized = self.resizer(text_memory)

            # Concat on the sequence dimension
            src = torch.cat([src, text_memory_resized], dim=0)
            # For mask, sequence dimension is second
            mask = torch.cat([mask, text_attention_mask], dim=1)
            # Pad the pos_embed with 0 so that the addition will be a no-op for the text tokens
            pos_embed = torch.cat([pos_embed, torch.zeros_like(text_memory_resized)], dim=0)

            img_memory = self.encoder(src, src_key_padding_mask=mask, pos=pos_embed)
            text_memory = img_memory[-len(text_memory_resized):]
            assert img_memory.shape[1] == text_memory.shape[1] == tgt.shape[1]
            return {
                "text_memory_resized": text_memory_resized,
                "text_memory": text_memory,
                "img_memory": img_memory,
                "mask": mask,
                "text_attention_mask": text_attention_mask,
                "pos_embed": pos_embed,
                "query_embed": query_embed,
                "tokenized": tokenized,
            }
        else:
            tgt = torch.zeros_like(query_embed)
            assert img_memory.shape[1] == text_memory.shape[1] == tgt.shape[1]
            hs = self.decoder(tgt, img_memory, text_memory, memory_key_padding_mask=mask,
                              text_memory_key_padding_mask=text_attention_mask, pos=pos_embed, query_pos=query_embed)
            return hs.transpose(1, 2)


class TransformerEncoder(nn.Module):
    def __init__(self, encoder_layer, num_layers, norm=None):
        super().__init__()
        self.layers = _get_clones(encoder_layer, num_layers)
        self.norm = norm

    def forward(self, src, mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
                pos: Optional[Tensor] = None):
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask, pos=pos)
        if self.norm is not None:
            output = self.norm(output)
        return output


class TransformerDecoder(nn.Module):
    def __init__(self, decoder_layer, num_layers, norm=None, return_intermediate=False):
        super().__init__()
        self.layers = _get_clones(decoder_layer, num_layers)
        self.norm = norm
        self.return_intermediate = return_intermediate

    def forward(self, tgt, memory, text_memory, tgt_mask=None, memory_mask=None, text_memory_key_padding_mask=None,
                tgt_key_padding_mask=None, memory_key_padding_mask=None, pos=None, query_pos=None):
        output = tgt
        intermediate = []
        for layer in self.layers:
            output = layer(output, memory, text_memory=text_memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                           text_memory_key_padding_mask=text_memory_key_padding_mask,
                           tgt_key_padding_mask=tgt_key_padding_mask,
                           memory_key_padding_mask=memory_key_padding_mask, pos=pos, query_pos=query_pos)
            if self.return_intermediate:
                intermediate.append(self.norm(output))
        if self.norm is not None:
            output = self.norm(output)
            if self.return_intermediate:
                intermediate.pop()
                intermediate.append(output)
        if self.return_intermediate:
            return torch.stack(intermediate)
        return output


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu"):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = _get_activation_fn(activation)

    def with_pos_embed(self, tensor, pos: Optional[Tensor]):
        return tensor if pos is None else tensor + pos

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos=None):
        q = k = self.with_pos_embed(src, pos)
        src2 = self.self_attn(q, k, value=src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)[0]
        src = src + self.dropout1(src2)
        src = self.norm1(src)
        src2 = self.linear2(self.dropout(self.activation(self.linear1(src))))
        src = src + self.dropout2(src2)
        return self.norm2(src)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu"):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.cross_attn_image = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.norm4 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.dropout4 = nn.Dropout(dropout)
        self.activation = _get_activation_fn(activation)

    def with_pos_embed(self, tensor, pos: Optional[Tensor]):
        return tensor if pos is None else tensor + pos

    def forward(self, tgt, memory, text_memory, tgt_mask=None, memory_mask=None, text_memory_key_padding_mask=None,
                tgt_key_padding_mask=None, memory_key_padding_mask=None, pos=None, query_pos=None):
        q = k = self.with_pos_embed(tgt, query_pos)
        # Self attention (object queries: none padded)
        tgt2 = self.self_attn(q, k, value=tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        tgt = tgt + self.dropout1(tgt2)
        tgt = self.norm1(tgt)
        # Cross attention to image (joint image+text memory, joint padding mask)
        tgt2 = self.cross_attn_image(query=self.with_pos_embed(tgt, query_pos), key=self.with_pos_embed(memory, pos),
                                     value=memory, attn_mask=memory_mask,
                                     key_padding_mask=memory_key_padding_mask)[0]
        tgt = tgt + self.dropout3(tgt2)
        tgt = self.norm3(tgt)
        tgt2 = self.linear2(self.dropout(self.activation(self.linear1(tgt))))
        tgt = tgt + self.dropout4(tgt2)
        return self.norm4(tgt)


class FeatureResizer(nn.Module):
    def __init__(self, input_feat_size, output_feat_size, dropout, do_ln=True):
        super().__init__()
        self.do_ln = do_ln
        self.fc = nn.Linear(input_feat_size, output_feat_size, bias=True)
        self.layer_norm = nn.LayerNorm(output_feat_size, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, encoder_features):
        x = self.fc(encoder_features)
        if self.do_ln:
            x = self.layer_norm(x)
        return self.dropout(x)


def _get_clones(module, N):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


def _get_activation_fn(activation):
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    raise RuntimeError(activation)


# ----------------------------------------------------------------------- mdetr.py
class MDETR(nn.Module):
    def __init__(self, backbone, transformer, num_classes, num_queries):
        super().__init__()
        self.num_queries = num_queries
        self.transformer = transformer
        hidden_dim = transformer.d_model
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.bbox_embed = nn.Linear(hidden_dim, 4)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.input_proj = nn.Conv2d(backbone.num_channels, hidden_dim, kernel_size=1)
        self.backbone = backbone

    def forward(self, samples, captions, encode_and_save=True, memory_cache=None):
        if not isinstance(samples, NestedTensor):
            samples = NestedTensor.from_tensor_list(samples)
        if encode_and_save:
            assert memory_cache is None
            features, pos = self.backbone(samples)
            src, mask = features[-1].decompose()
            query_embed = self.query_embed.weight
            return self.transformer(self.input_proj(src), mask, query_embed, pos[-1], captions, encode_and_save=True)
        assert memory_cache is not None
        hs = self.transformer(mask=memory_cache["mask"], query_embed=memory_cache["query_embed"],
                              pos_embed=memory_cache["pos_embed"], encode_and_save=False,
                              text_memory=memory_cache["text_memory_resized"], img_memory=memory_cache["img_memory"],
                              text_attention_mask=memory_cache["text_attention_mask"])
        return {"pred_logits": self.class_embed(hs)[-1], "pred_boxes": self.bbox_embed(hs).sigmoid()[-1], "hs": hs}


def tokenize(captions, pad_id=1):
    """batch_encode_plus(padding="longest"): right padding, attention_mask 1 = token."""
    L = max(len(c) for c in captions)
    ids = torch.full((len(captions), L), pad_id, dtype=torch.long)
    att = torch.zeros((len(captions), L), dtype=torch.long)
    for i, c in enumerate(captions):
        ids[i, : len(c)] = torch.tensor(c)
        att[i, : len(c)] = 1
    return {"input_ids": ids, "attention_mask": att}


def main():
    torch.manual_seed(0)
    cfg = RobertaConfig(vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=48, max_position_embeddings=40, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, type_vocab_size=1)
    text_encoder = RobertaModel(cfg, add_pooling_layer=False)
    transformer = Transformer(text_encoder, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                              dim_feedforward=64)
    backbone = Joiner(16, PositionEmbeddingSine(16, normalize=True))
    model = MDETR(backbone, transformer, num_classes=5, num_queries=6)
    model.eval()

    images = [torch.randn(3, 12, 16), torch.randn(3, 16, 10), torch.randn(3, 8, 8)]
    captions = [[0, 5, 9, 7, 2], [0, 11, 2], [0, 6, 8, 13, 21, 17, 2]]

    ok = True
    with torch.no_grad():
        memory_cache = model(images, tokenize(captions), encode_and_save=True)
        out = model(images, tokenize(captions), encode_and_save=False, memory_cache=memory_cache)
        H, W = 16 // 2, 16 // 2  # padded feature map
        n_img = H * W
        for i, (img, cap) in enumerate(zip(images, captions)):
            mc = model([img], tokenize([cap]), encode_and_save=True)
            o = model([img], tokenize([cap]), encode_and_save=False, memory_cache=mc)
            ok &= torch.allclose(out["hs"][:, i], o["hs"][:, 0], atol=1e-5)
            ok &= torch.allclose(out["pred_boxes"][i], o["pred_boxes"][0], atol=1e-5)
            # valid image positions of the joint memory
            h, w = img.shape[1] // 2, img.shape[2] // 2
            mem_img = memory_cache["img_memory"][:n_img, i].view(H, W, -1)[:h, :w].reshape(h * w, -1)
            ok &= torch.allclose(mem_img, mc["img_memory"][: h * w, 0], atol=1e-5)
            # valid text positions
            t = len(cap)
            ok &= torch.allclose(memory_cache["text_memory"][:t, i], mc["text_memory"][:t, 0], atol=1e-5)
            ok &= bool(memory_cache["mask"][i].sum() == (n_img - h * w) + (memory_cache["mask"].shape[1] - n_img - t))
    print("joint key padding mask shape:", tuple(memory_cache["mask"].shape),
          "padded keys per sample:", memory_cache["mask"].sum(1).tolist())
    print("batched MDETR matches each pair run alone:", ok)
    print("MATCH" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
