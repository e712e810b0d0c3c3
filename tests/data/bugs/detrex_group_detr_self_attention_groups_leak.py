# detrex (IDEA-Research/detrex#238, "[Bug Fix] Fix the Group-DETR implementation bugs", head commit cdb60a9):
# GroupConditionalSelfAttention splits the 11 query groups into the batch axis for training, but then reshapes
# with the pre-split (N, B) sizes, so the groups are interleaved back together and every group attends to all others.
import sys
import warnings

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class GroupConditionalSelfAttention(nn.Module):
    """Conditional Self-Attention Module used in Group-DETR (projects/group_detr/modeling/attention.py)."""

    def __init__(self, embed_dim, num_heads, attn_drop=0.0, proj_drop=0.0, group_nums=11, batch_first=False, **kwargs):
        super(GroupConditionalSelfAttention, self).__init__()
        self.query_content_proj = nn.Linear(embed_dim, embed_dim)
        self.query_pos_proj = nn.Linear(embed_dim, embed_dim)
        self.key_content_proj = nn.Linear(embed_dim, embed_dim)
        self.key_pos_proj = nn.Linear(embed_dim, embed_dim)
        self.value_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj_drop = nn.Dropout(proj_drop)
        self.group_nums = group_nums
        self.num_heads = num_heads
        self.embed_dim = embed_dim
        head_dim = embed_dim // num_heads
        self.scale = head_dim**-0.5
        self.batch_first = batch_first

    def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_pos=None,
                attn_mask=None, key_padding_mask=None, **kwargs):
        if key is None:
            key = query
        if value is None:
            value = key
        if identity is None:
            identity = query
        if key_pos is None:
            if query_pos is not None:
                if query_pos.shape == key.shape:
                    key_pos = query_pos
                else:
                    warnings.warn(f"position encoding of key is" f"missing in {self.__class__.__name__}.")

        assert query_pos is not None and key_pos is not None, \
            "query_pos and key_pos must be passed into ConditionalAttention Module"

        if self.batch_first:
            query = query.transpose(0, 1)
            key = key.transpose(0, 1)
            value = value.transpose(0, 1)
            query_pos = query_pos.transpose(0, 1)
            key_pos = key_pos.transpose(0, 1)
            identity = identity.transpose(0, 1)

        query_content = self.query_content_proj(query)
        query_pos = self.query_pos_proj(query_pos)
        key_content = self.key_content_proj(key)
        key_pos = self.key_pos_proj(key_pos)
        value = self.value_proj(value)

        if not FIXED:
            # detrex main: sizes taken before the group split
            N, B, C = query_content.shape
            q = query_content + query_pos
            k = key_content + key_pos
            v = value

            # hack in attention layer to implement group-detr
            if self.training:
                q = torch.cat(q.split(N // self.group_nums, dim=0), dim=1)
                k = torch.cat(k.split(N // self.group_nums, dim=0), dim=1)
                v = torch.cat(v.split(N // self.group_nums, dim=0), dim=1)
        else:
            # PR #238 head (cdb60a9): sizes taken after the group split
            num_queries, bs, n_model = query_content.shape
            q = query_content + query_pos
            k = key_content + key_pos
            v = value
            if self.training:
                q = torch.cat(q.split(num_queries // self.group_nums, dim=0), dim=1)
                k = torch.cat(k.split(num_queries // self.group_nums, dim=0), dim=1)
                v = torch.cat(v.split(num_queries // self.group_nums, dim=0), dim=1)
            N, B, C = q.shape

        q = q.reshape(N, B, self.num_heads, C // self.num_heads).permute(1, 2, 0, 3)  # (B, num_heads, N, head_dim)
        k = k.reshape(N, B, self.num_heads, C // self.num_heads).permute(1, 2, 0, 3)
        v = v.reshape(N, B, self.num_heads, C // self.num_heads).permute(1, 2, 0, 3)

        q = q * self.scale
        attn = q @ k.transpose(-2, -1)

        # add attention mask
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn.masked_fill_(attn_mask, float("-inf"))
            else:
                attn += attn_mask
        if key_padding_mask is not None:
            attn = attn.masked_fill_(key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf"))

        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)

        if not FIXED:
            out = (attn @ v).transpose(1, 2).reshape(B, N, C)
        else:
            out = (attn @ v).transpose(1, 2).reshape(bs, num_queries, C)
        out = self.out_proj(out)

        if not self.batch_first:
            out = out.transpose(0, 1)

        if self.training:
            if not FIXED:
                out = torch.cat(out.split(B, dim=1), dim=0)
            else:
                out = torch.cat(out.split(bs, dim=1), dim=0)

        return identity + self.proj_drop(out)


def main():
    torch.manual_seed(0)
    embed_dim, num_heads, num_queries, group_nums = 32, 4, 5, 3
    attn = GroupConditionalSelfAttention(embed_dim, num_heads, group_nums=group_nums, batch_first=False)
    # GroupDETR: query_embed = nn.Embedding(num_queries * group_nums, embed_dim); training uses all groups.
    query_embed = nn.Embedding(num_queries * group_nums, embed_dim)
    bs = 1  # the PR's reshape (bs, num_queries, C) is batch-1 only; keep the scenario it targets
    tgt = torch.randn(num_queries * group_nums, bs, embed_dim)
    pos = query_embed.weight[:, None, :].repeat(1, bs, 1)

    with torch.no_grad():
        attn.train()  # dropout is 0.0; training mode switches on the group split
        out = attn(tgt, query_pos=pos)

        # reference: the point of Group-DETR -- each group of queries is decoded on its own
        attn.eval()
        ref = torch.cat([
            attn(tgt[g * num_queries:(g + 1) * num_queries], query_pos=pos[g * num_queries:(g + 1) * num_queries])
            for g in range(group_nums)
        ], dim=0)

        # leak probe: change group 2's queries only and see whether group 0 moves
        attn.train()
        tgt2 = tgt.clone()
        tgt2[2 * num_queries:] += torch.randn_like(tgt2[2 * num_queries:])
        out2 = attn(tgt2, query_pos=pos)

    diff = (out - ref).abs().max().item()
    leak = (out2[:num_queries] - out[:num_queries]).abs().max().item()
    print(f"group-split train output vs per-group reference: max|diff| = {diff:.6f}")
    print(f"group 0 output change when only group 2 changes: {leak:.6f}")


if __name__ == "__main__":
    main()
