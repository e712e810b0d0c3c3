# Citation: facebookresearch/detr models/transformer.py (Transformer, TransformerEncoderLayer, TransformerDecoderLayer)
#   and util/misc.py nested_tensor_from_tensor_list (pixel mask, True on padded pixels).
# The pixel mask (bool, True = padding) is downsampled to the feature map, flattened, and passed as
# key_padding_mask to nn.MultiheadAttention in the encoder and as memory_key_padding_mask in the decoder's
# cross-attention; object queries are never masked. Right: padded pixels are never attended to as keys.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=64, dropout=0.0):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def with_pos_embed(self, tensor, pos):
        return tensor if pos is None else tensor + pos

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos=None):
        q = k = self.with_pos_embed(src, pos)
        src2 = self.self_attn(q, k, value=src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)[0]
        src = self.norm1(src + src2)
        src2 = self.linear2(F.relu(self.linear1(src)))
        return self.norm2(src + src2)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=64, dropout=0.0):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.multihead_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)

    def with_pos_embed(self, tensor, pos):
        return tensor if pos is None else tensor + pos

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, pos=None, query_pos=None):
        q = k = self.with_pos_embed(tgt, query_pos)
        tgt2 = self.self_attn(q, k, value=tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        tgt = self.norm1(tgt + tgt2)
        tgt2 = self.multihead_attn(query=self.with_pos_embed(tgt, query_pos),
                                   key=self.with_pos_embed(memory, pos),
                                   value=memory, attn_mask=memory_mask,
                                   key_padding_mask=memory_key_padding_mask)[0]
        tgt = self.norm2(tgt + tgt2)
        tgt2 = self.linear2(F.relu(self.linear1(tgt)))
        return self.norm3(tgt + tgt2)


class Transformer(nn.Module):
    def __init__(self, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2):
        super().__init__()
        self.encoder = nn.ModuleList([TransformerEncoderLayer(d_model, nhead) for _ in range(num_encoder_layers)])
        self.decoder = nn.ModuleList([TransformerDecoderLayer(d_model, nhead) for _ in range(num_decoder_layers)])
        self.d_model = d_model

    def forward(self, src, mask, query_embed, pos_embed):
        bs, c, h, w = src.shape
        src = src.flatten(2).permute(2, 0, 1)
        pos_embed = pos_embed.flatten(2).permute(2, 0, 1)
        query_embed = query_embed.unsqueeze(1).repeat(1, bs, 1)
        mask = mask.flatten(1)
        tgt = torch.zeros_like(query_embed)
        memory = src
        for layer in self.encoder:
            memory = layer(memory, src_key_padding_mask=mask, pos=pos_embed)
        hs = tgt
        for layer in self.decoder:
            hs = layer(hs, memory, memory_key_padding_mask=mask, pos=pos_embed, query_pos=query_embed)
        return hs.transpose(0, 1), memory.permute(1, 2, 0).view(bs, c, h, w)


def nested_tensor_from_tensor_list(tensor_list):
    max_size = [max(s) for s in zip(*[img.shape for img in tensor_list])]
    batch_shape = [len(tensor_list)] + max_size
    b, c, h, w = batch_shape
    tensor = torch.zeros(batch_shape)
    mask = torch.ones((b, h, w), dtype=torch.bool)
    for img, pad_img, m in zip(tensor_list, tensor, mask):
        pad_img[: img.shape[0], : img.shape[1], : img.shape[2]].copy_(img)
        m[: img.shape[1], :img.shape[2]] = False
    return tensor, mask


# two images of different sizes, padded bottom/right like DETR's collate_fn
imgs = [torch.randn(3, 64, 48), torch.randn(3, 40, 64)]
samples, pixel_mask = nested_tensor_from_tensor_list(imgs)
backbone = nn.Conv2d(3, 32, kernel_size=8, stride=8)   # stand-in for ResNet, stride 8
features = backbone(samples)
# models/backbone.py Joiner/BackboneBase: mask downsampled by F.interpolate to the feature size
mask = F.interpolate(pixel_mask[None].float(), size=features.shape[-2:]).to(torch.bool)[0]
pos = torch.randn_like(features) * 0.1
query_embed = nn.Embedding(10, 32)
model = Transformer()
hs, memory = model(features, mask, query_embed.weight, pos)
class_embed = nn.Linear(32, 5)
logits = class_embed(hs)
loss = F.cross_entropy(logits.flatten(0, 1), torch.randint(0, 5, (logits.shape[0] * logits.shape[1],)))
loss.backward()
print("masked keys per image:", mask.flatten(1).sum(1).tolist(), "loss %.4f" % loss.item())
