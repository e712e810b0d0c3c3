# ultralytics/ultralytics#25834 ("Cap RT-DETR denoising queries at the query budget").
#
# RT-DETR training: get_cdn_group (ultralytics/models/utils/ops.py) builds the contrastive denoising block
# (positive + negative noised copies of every ground-truth box, padded to the largest image in the batch) and the
# decoder self-attention mask over [denoising queries | matching queries]. The mask blocks matching queries from
# the denoising block and the denoising groups from one another; RTDETRDecoder passes it to every decoder
# layer's nn.MultiheadAttention.
#
# Bug: the group was sized from the image with the most boxes, not from the `num_dn` budget. With
# `num_group = num_dn // max_nums` floored to 1, an image with more boxes than `num_dn` emitted 2 * max_nums
# denoising queries, and the self-attention mask (and the denoising groups each query attends within)
# grew with the box count instead of staying at the budgeted size.
# Fix: images with more than `num_dn` boxes denoise a random subset of `num_dn` of them (redrawn each call), so
# the denoising block and its mask stay at the budget.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


def xywh2xyxy(x):
    y = torch.empty_like(x)
    dw = x[..., 2] / 2
    dh = x[..., 3] / 2
    y[..., 0] = x[..., 0] - dw
    y[..., 1] = x[..., 1] - dh
    y[..., 2] = x[..., 0] + dw
    y[..., 3] = x[..., 1] + dh
    return y


def xyxy2xywh(x):
    y = torch.empty_like(x)
    y[..., 0] = (x[..., 0] + x[..., 2]) / 2
    y[..., 1] = (x[..., 1] + x[..., 3]) / 2
    y[..., 2] = x[..., 2] - x[..., 0]
    y[..., 3] = x[..., 3] - x[..., 1]
    return y


def inverse_sigmoid(x, eps=1e-6):
    x = x.clip(min=0.0, max=1.0)
    return torch.log(x / (1 - x + eps) + eps)


def _cap_gt_to_budget(batch, num_dn):
    """Keep at most num_dn boxes per image, a random subset redrawn on every call."""
    gt_groups = batch["gt_groups"]
    b_idx = batch["batch_idx"].long()
    keep = []
    for i, n in enumerate(gt_groups):
        idx = torch.nonzero(b_idx == i).squeeze(-1)
        if n > num_dn:
            idx = idx[torch.randperm(n)[:num_dn].sort().values]
        keep.append(idx)
    keep = torch.cat(keep)
    return {
        "cls": batch["cls"][keep],
        "bboxes": batch["bboxes"][keep],
        "batch_idx": batch["batch_idx"][keep],
        "gt_groups": [min(n, num_dn) for n in gt_groups],
    }


def get_cdn_group(
    batch, num_classes, num_queries, class_embed, num_dn=100, cls_noise_ratio=0.5, box_noise_scale=1.0, training=False
):
    if (not training) or num_dn <= 0 or batch is None:
        return None, None, None, None
    if FIXED:
        batch = _cap_gt_to_budget(batch, num_dn)
    gt_groups = batch["gt_groups"]
    total_num = sum(gt_groups)
    max_nums = max(gt_groups)
    if max_nums == 0:
        return None, None, None, None

    num_group = num_dn // max_nums
    num_group = 1 if num_group == 0 else num_group
    # Pad gt to max_num of a batch
    bs = len(gt_groups)
    gt_cls = batch["cls"]  # (bs*num, )
    gt_bbox = batch["bboxes"]  # bs*num, 4
    b_idx = batch["batch_idx"]

    # Each group has positive and negative queries.
    dn_cls = gt_cls.repeat(2 * num_group)  # (2*num_group*bs*num, )
    dn_bbox = gt_bbox.repeat(2 * num_group, 1)  # 2*num_group*bs*num, 4
    dn_b_idx = b_idx.repeat(2 * num_group).view(-1)  # (2*num_group*bs*num, )

    # Positive and negative mask
    # (bs*num*num_group, ), the second total_num*num_group part as negative samples
    neg_idx = torch.arange(total_num * num_group, dtype=torch.long, device=gt_bbox.device) + num_group * total_num

    if cls_noise_ratio > 0:
        # Half of bbox prob
        mask = torch.rand(dn_cls.shape) < (cls_noise_ratio * 0.5)
        idx = torch.nonzero(mask).squeeze(-1)
        # Randomly put a new one here
        new_label = torch.randint_like(idx, 0, num_classes, dtype=dn_cls.dtype, device=dn_cls.device)
        dn_cls[idx] = new_label

    if box_noise_scale > 0:
        known_bbox = xywh2xyxy(dn_bbox)

        diff = (dn_bbox[..., 2:] * 0.5).repeat(1, 2) * box_noise_scale  # 2*num_group*bs*num, 4

        rand_sign = torch.randint_like(dn_bbox, 0, 2) * 2.0 - 1.0
        rand_part = torch.rand_like(dn_bbox)
        rand_part[neg_idx] += 1.0
        rand_part *= rand_sign
        known_bbox += rand_part * diff
        known_bbox.clip_(min=0.0, max=1.0)
        dn_bbox = xyxy2xywh(known_bbox)
        dn_bbox = inverse_sigmoid(dn_bbox)

    num_dn = int(max_nums * 2 * num_group)  # total denoising queries
    dn_cls_embed = class_embed[dn_cls]  # bs*num * 2 * num_group, 256
    padding_cls = torch.zeros(bs, num_dn, dn_cls_embed.shape[-1], device=gt_cls.device)
    padding_bbox = torch.zeros(bs, num_dn, 4, device=gt_bbox.device)

    map_indices = torch.cat([torch.tensor(range(num), dtype=torch.long) for num in gt_groups])
    pos_idx = torch.stack([map_indices + max_nums * i for i in range(num_group)], dim=0)

    map_indices = torch.cat([map_indices + max_nums * i for i in range(2 * num_group)])
    padding_cls[(dn_b_idx, map_indices)] = dn_cls_embed
    padding_bbox[(dn_b_idx, map_indices)] = dn_bbox

    tgt_size = num_dn + num_queries
    attn_mask = torch.zeros([tgt_size, tgt_size], dtype=torch.bool)
    # Match query cannot see the reconstruct
    attn_mask[num_dn:, :num_dn] = True
    # Reconstruct cannot see each other
    for i in range(num_group):
        if i == 0:
            attn_mask[max_nums * 2 * i : max_nums * 2 * (i + 1), max_nums * 2 * (i + 1) : num_dn] = True
        if i == num_group - 1:
            attn_mask[max_nums * 2 * i : max_nums * 2 * (i + 1), : max_nums * i * 2] = True
        else:
            attn_mask[max_nums * 2 * i : max_nums * 2 * (i + 1), max_nums * 2 * (i + 1) : num_dn] = True
            attn_mask[max_nums * 2 * i : max_nums * 2 * (i + 1), : max_nums * 2 * i] = True
    dn_meta = {
        "dn_pos_idx": [p.reshape(-1) for p in pos_idx.cpu().split(list(gt_groups), dim=1)],
        "dn_num_group": num_group,
        "dn_num_split": [num_dn, num_queries],
        "gt_bboxes": batch["bboxes"],
        "gt_groups": list(gt_groups),
    }

    return (
        padding_cls.to(class_embed.device),
        padding_bbox.to(class_embed.device),
        attn_mask.to(class_embed.device),
        dn_meta,
    )


class MLP(nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        self.num_layers = num_layers
        h = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim, *h], [*h, output_dim]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) if i < self.num_layers - 1 else layer(x)
        return x


class DeformableTransformerDecoderLayer(nn.Module):
    """Self-attention as ultralytics writes it; the deformable cross-attention is a plain attention over memory here."""

    def __init__(self, d_model=32, n_heads=4, d_ffn=64):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, n_heads, dropout=0.0)
        self.norm1 = nn.LayerNorm(d_model)
        self.cross_attn = nn.MultiheadAttention(d_model, n_heads, dropout=0.0, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, d_ffn)
        self.linear2 = nn.Linear(d_ffn, d_model)
        self.norm3 = nn.LayerNorm(d_model)

    @staticmethod
    def with_pos_embed(tensor, pos):
        return tensor if pos is None else tensor + pos

    def forward(self, embed, refer_bbox, feats, attn_mask=None, query_pos=None):
        # Self attention
        q = k = self.with_pos_embed(embed, query_pos)
        tgt = self.self_attn(q.transpose(0, 1), k.transpose(0, 1), embed.transpose(0, 1), attn_mask=attn_mask)[
            0
        ].transpose(0, 1)
        embed = self.norm1(embed + tgt)
        # Cross attention
        tgt = self.cross_attn(self.with_pos_embed(embed, query_pos), feats, feats)[0]
        embed = self.norm2(embed + tgt)
        # FFN
        embed = self.norm3(embed + self.linear2(F.relu(self.linear1(embed))))
        return embed


class RTDETRDecoder(nn.Module):
    def __init__(self, nc=5, hd=32, nq=10, ndl=2, num_denoising=6, label_noise_ratio=0.5, box_noise_scale=1.0):
        super().__init__()
        self.nc = nc
        self.hidden_dim = hd
        self.num_queries = nq
        self.num_denoising = num_denoising
        self.label_noise_ratio = label_noise_ratio
        self.box_noise_scale = box_noise_scale
        self.denoising_class_embed = nn.Embedding(nc, hd)
        self.tgt_embed = nn.Embedding(nq, hd)
        self.refer_bbox = nn.Embedding(nq, 4)
        self.query_pos_head = MLP(4, 2 * hd, hd, num_layers=2)
        self.layers = nn.ModuleList(DeformableTransformerDecoderLayer(hd) for _ in range(ndl))
        self.dec_score_head = nn.Linear(hd, nc)
        self.dec_bbox_head = MLP(hd, hd, 4, num_layers=3)

    def forward(self, feats, batch=None):
        bs = feats.shape[0]
        dn_embed, dn_bbox, attn_mask, dn_meta = get_cdn_group(
            batch,
            self.nc,
            self.num_queries,
            self.denoising_class_embed.weight,
            self.num_denoising,
            self.label_noise_ratio,
            self.box_noise_scale,
            self.training,
        )
        embeddings = self.tgt_embed.weight.unsqueeze(0).repeat(bs, 1, 1)
        refer_bbox = self.refer_bbox.weight.unsqueeze(0).repeat(bs, 1, 1)
        if dn_embed is not None:
            embeddings = torch.cat([dn_embed, embeddings], 1)
            refer_bbox = torch.cat([dn_bbox, refer_bbox], 1)
        refer_bbox = refer_bbox.sigmoid()
        output = embeddings
        for layer in self.layers:
            output = layer(output, refer_bbox, feats, attn_mask, self.query_pos_head(refer_bbox))
            refer_bbox = torch.sigmoid(self.dec_bbox_head(output) + inverse_sigmoid(refer_bbox)).detach()
        dec_bboxes = torch.sigmoid(self.dec_bbox_head(output) + inverse_sigmoid(refer_bbox))
        dec_scores = self.dec_score_head(output)
        return dec_bboxes, dec_scores, dn_meta


def dn_l1_loss(dec_bboxes, dn_meta):
    """Denoising box loss: positive denoising queries against their ground truths (ultralytics RTDETRDetectionLoss)."""
    dn_num_dn, _ = dn_meta["dn_num_split"]
    dn_bboxes = dec_bboxes[:, :dn_num_dn]
    gt = dn_meta["gt_bboxes"].split(dn_meta["gt_groups"])
    losses = []
    for i, pos in enumerate(dn_meta["dn_pos_idx"]):
        if len(pos) == 0:
            continue
        tgt = gt[i].repeat(dn_meta["dn_num_group"], 1)
        losses.append((dn_bboxes[i, pos] - tgt).abs().sum(-1))
    return torch.cat(losses).mean()


def make_batch():
    gen = torch.Generator().manual_seed(1)
    gt_groups = [14, 3]  # a dense image (more boxes than num_denoising) and a sparse one
    cls, bboxes, batch_idx = [], [], []
    for i, n in enumerate(gt_groups):
        cls.append(torch.randint(0, 5, (n,), generator=gen))
        xy = torch.rand(n, 2, generator=gen) * 0.6 + 0.2
        wh = torch.rand(n, 2, generator=gen) * 0.2 + 0.05
        bboxes.append(torch.cat([xy, wh], -1))
        batch_idx.append(torch.full((n,), i, dtype=torch.long))
    return {
        "cls": torch.cat(cls),
        "bboxes": torch.cat(bboxes),
        "batch_idx": torch.cat(batch_idx),
        "gt_groups": gt_groups,
    }


def main():
    model = RTDETRDecoder()
    model.train()
    feats = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    batch = make_batch()
    torch.manual_seed(3)
    dec_bboxes, dec_scores, dn_meta = model(feats, batch)
    loss = dn_l1_loss(dec_bboxes, dn_meta)
    num_dn, nq = dn_meta["dn_num_split"]
    print(f"denoising queries: {num_dn}, matching queries: {nq}, groups: {dn_meta['dn_num_group']}")
    print(f"decoder queries per image: {dec_bboxes.shape[1]}")
    print(f"dn box l1 loss: {loss.item():.6f}")
    print(f"matching-query score mean: {dec_scores[:, num_dn:].mean().item():.6f}")


if __name__ == "__main__":
    main()
