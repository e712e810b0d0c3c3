# Citation: IDEA-Research/DINO models/dino/dn_components.py prepare_for_cdn (attn_mask) and
#   models/dino/deformable_transformer.py DeformableTransformerDecoderLayer.forward_sa (self_attn attn_mask=self_attn_mask).
# Contrastive denoising: bool attn_mask (True = blocked) of size (pad_size + num_queries)^2. Matching queries cannot
# see any denoising query; each denoising group (positive+negative, 2*single_pad rows) sees only itself and the
# matching queries. Every row keeps at least its own group, so no row is fully masked. The cross-attention is stood
# in for by nn.MultiheadAttention over the flattened memory with the image padding mask (deformable attn in DINO).
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)

num_queries, hidden_dim, num_classes = 12, 32, 6
dn_number, label_noise_ratio, box_noise_scale = 6, 0.5, 1.0
label_enc = nn.Embedding(num_classes + 1, hidden_dim)

targets = [{"labels": torch.tensor([1, 3]), "boxes": torch.rand(2, 4) * 0.5 + 0.25},
           {"labels": torch.tensor([2, 0, 4]), "boxes": torch.rand(3, 4) * 0.5 + 0.25}]


def prepare_for_cdn(dn_args, training, num_queries, num_classes, hidden_dim, label_enc):
    targets, dn_number, label_noise_ratio, box_noise_scale = dn_args
    dn_number = dn_number * 2
    known = [(torch.ones_like(t['labels'])) for t in targets]
    batch_size = len(known)
    known_num = [sum(k) for k in known]
    if int(max(known_num)) == 0:
        dn_number = 1
    else:
        if dn_number >= 100:
            dn_number = dn_number // (int(max(known_num) * 2))
        elif dn_number < 1:
            dn_number = 1
    if dn_number == 0:
        dn_number = 1
    unmask_bbox = unmask_label = torch.cat(known)
    labels = torch.cat([t['labels'] for t in targets])
    boxes = torch.cat([t['boxes'] for t in targets])
    batch_idx = torch.cat([torch.full_like(t['labels'].long(), i) for i, t in enumerate(targets)])
    known_indice = torch.nonzero(unmask_label + unmask_bbox)
    known_indice = known_indice.view(-1)
    known_indice = known_indice.repeat(2 * dn_number, 1).view(-1)
    known_labels = labels.repeat(2 * dn_number, 1).view(-1)
    known_bid = batch_idx.repeat(2 * dn_number, 1).view(-1)
    known_bboxs = boxes.repeat(2 * dn_number, 1)
    known_labels_expaned = known_labels.clone()
    known_bbox_expand = known_bboxs.clone()
    if label_noise_ratio > 0:
        p = torch.rand_like(known_labels_expaned.float())
        chosen_indice = torch.nonzero(p < (label_noise_ratio * 0.5)).view(-1)
        new_label = torch.randint_like(chosen_indice, 0, num_classes)
        known_labels_expaned.scatter_(0, chosen_indice, new_label)
    single_pad = int(max(known_num))
    pad_size = int(single_pad * 2 * dn_number)
    positive_idx = torch.tensor(range(len(boxes))).long().unsqueeze(0).repeat(dn_number, 1)
    positive_idx += (torch.tensor(range(dn_number)) * len(boxes) * 2).long().unsqueeze(1)
    positive_idx = positive_idx.flatten()
    negative_idx = positive_idx + len(boxes)
    if box_noise_scale > 0:
        known_bbox_ = torch.zeros_like(known_bboxs)
        known_bbox_[:, :2] = known_bboxs[:, :2] - known_bboxs[:, 2:] / 2
        known_bbox_[:, 2:] = known_bboxs[:, :2] + known_bboxs[:, 2:] / 2
        diff = torch.zeros_like(known_bboxs)
        diff[:, :2] = known_bboxs[:, 2:] / 2
        diff[:, 2:] = known_bboxs[:, 2:] / 2
        rand_sign = torch.randint_like(known_bboxs, low=0, high=2, dtype=torch.float32) * 2.0 - 1.0
        rand_part = torch.rand_like(known_bboxs)
        rand_part[negative_idx] += 1.0
        rand_part *= rand_sign
        known_bbox_ = known_bbox_ + torch.mul(rand_part, diff) * box_noise_scale
        known_bbox_ = known_bbox_.clamp(min=0.0, max=1.0)
        known_bbox_expand[:, :2] = (known_bbox_[:, :2] + known_bbox_[:, 2:]) / 2
        known_bbox_expand[:, 2:] = known_bbox_[:, 2:] - known_bbox_[:, :2]
    m = known_labels_expaned.long()
    input_label_embed = label_enc(m)
    input_bbox_embed = torch.logit(known_bbox_expand.clamp(1e-3, 1 - 1e-3))
    padding_label = torch.zeros(pad_size, hidden_dim)
    padding_bbox = torch.zeros(pad_size, 4)
    input_query_label = padding_label.repeat(batch_size, 1, 1)
    input_query_bbox = padding_bbox.repeat(batch_size, 1, 1)
    map_known_indice = torch.tensor([])
    if len(known_num):
        map_known_indice = torch.cat([torch.tensor(range(num)) for num in known_num])
        map_known_indice = torch.cat([map_known_indice + single_pad * i for i in range(2 * dn_number)]).long()
    if len(known_bid):
        input_query_label[(known_bid.long(), map_known_indice)] = input_label_embed
        input_query_bbox[(known_bid.long(), map_known_indice)] = input_bbox_embed

    tgt_size = pad_size + num_queries
    attn_mask = torch.ones(tgt_size, tgt_size) < 0
    # match query cannot see the reconstruct
    attn_mask[pad_size:, :pad_size] = True
    # reconstruct cannot see each other
    for i in range(dn_number):
        if i == 0:
            attn_mask[single_pad * 2 * i:single_pad * 2 * (i + 1), single_pad * 2 * (i + 1):pad_size] = True
        if i == dn_number - 1:
            attn_mask[single_pad * 2 * i:single_pad * 2 * (i + 1), :single_pad * i * 2] = True
        else:
            attn_mask[single_pad * 2 * i:single_pad * 2 * (i + 1), single_pad * 2 * (i + 1):pad_size] = True
            attn_mask[single_pad * 2 * i:single_pad * 2 * (i + 1), :single_pad * 2 * i] = True
    dn_meta = {'pad_size': pad_size, 'num_dn_group': dn_number}
    return input_query_label, input_query_bbox, attn_mask, dn_meta


class DecoderLayer(nn.Module):
    def __init__(self, d_model=32, n_heads=4):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, n_heads, dropout=0.0)
        self.cross_attn = nn.MultiheadAttention(d_model, n_heads, dropout=0.0)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.linear1, self.linear2 = nn.Linear(d_model, 64), nn.Linear(64, d_model)

    def forward(self, tgt, tgt_query_pos, memory, memory_key_padding_mask, self_attn_mask):
        # forward_sa
        q = k = tgt + tgt_query_pos
        tgt2 = self.self_attn(q, k, tgt, attn_mask=self_attn_mask)[0]
        tgt = self.norm2(tgt + tgt2)
        # forward_ca (deformable in DINO; dense here with the same padding mask)
        tgt2 = self.cross_attn(tgt + tgt_query_pos, memory, memory, key_padding_mask=memory_key_padding_mask)[0]
        tgt = self.norm1(tgt + tgt2)
        return self.norm3(tgt + self.linear2(F.relu(self.linear1(tgt))))


input_query_label, input_query_bbox, attn_mask, dn_meta = prepare_for_cdn(
    (targets, dn_number, label_noise_ratio, box_noise_scale), True, num_queries, num_classes, hidden_dim, label_enc)
bs = 2
tgt_match = torch.randn(bs, num_queries, hidden_dim)
tgt = torch.cat([input_query_label, tgt_match], dim=1)          # (bs, pad_size+nq, d)
ref = torch.cat([input_query_bbox, torch.randn(bs, num_queries, 4)], dim=1).sigmoid()
query_pos_head = nn.Linear(4, hidden_dim)
memory = torch.randn(bs, 30, hidden_dim)
memory_mask = torch.zeros(bs, 30, dtype=torch.bool)
memory_mask[1, 20:] = True                                       # second image has padded pixels
layers = nn.ModuleList([DecoderLayer(hidden_dim) for _ in range(2)])
out = tgt.transpose(0, 1)
for layer in layers:
    out = layer(out, query_pos_head(ref).transpose(0, 1), memory.transpose(0, 1), memory_mask, attn_mask)
out = out.transpose(0, 1)
pad = dn_meta['pad_size']
loss = out[:, :pad].pow(2).mean() + out[:, pad:].pow(2).mean()
loss.backward()
print("pad_size", pad, "groups", dn_meta['num_dn_group'], "loss %.4f" % loss.item())
