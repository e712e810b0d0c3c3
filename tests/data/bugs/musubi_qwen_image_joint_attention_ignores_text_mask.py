"""musubi-tuner Qwen-Image DiT: joint image+text attention ignores the text padding mask on the SDPA path.

Citation: kohya-ss/musubi-tuner#686 (issue), fixed by kohya-ss/musubi-tuner#688, commit 1b0a607
("fix: attention mask handling in Qwen-Image which ignores encoder_hidden_state_mask"); the same defect in
diffusers is huggingface/diffusers#12294.

Bug: ``Attention.forward`` of the double-stream block receives ``encoder_hidden_states_mask`` ([B, S_txt],
text padding of a batch of prompts) but hands ``hunyuan_attention(qkv, mode=..., attn_mask=attention_mask)``
the unused ``attention_mask`` argument (None). With ``split_attn`` off (plain SDPA over the padded batch),
every image and text token attends the padded text tokens of the shorter prompts.
(With ``split_attn`` on, each sample is cut to ``seq_img + txt_seq_lens`` and was correct.)
Fix: when not ``split_attn``, build ``attention_mask = cat([ones(B, seq_img), encoder_hidden_states_mask])``
shaped ``[B, 1, 1, S_img + S_txt]`` and pass it to SDPA.

This program: one double-stream attention (joint order [image, text]) as musubi-tuner wrote it, with the
``hunyuan_attention`` torch/SDPA helper, ``attn_mode="torch"``, ``split_attn=False``, 4 image tokens and a
batch of two prompts with 6 and 3 valid text tokens of 6.
"""
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def hunyuan_attention(qkv, mode="torch", attn_mask=None, total_len=None):
    """q, k, v: [B, S, H, D] -> [B, S, H*D]; total_len set means split attention per sample."""
    q, k, v = qkv
    qkv.clear()
    if total_len is not None:
        outs = []
        for i in range(q.shape[0]):
            n = int(total_len[i])
            o = F.scaled_dot_product_attention(
                q[i : i + 1, :n].transpose(1, 2), k[i : i + 1, :n].transpose(1, 2), v[i : i + 1, :n].transpose(1, 2)
            ).transpose(1, 2)
            outs.append(F.pad(o, (0, 0, 0, 0, 0, q.shape[1] - n)))
        return torch.cat(outs).flatten(2)
    assert mode == "torch"
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
    return x.transpose(1, 2).flatten(2)


class Attention(nn.Module):
    def __init__(self, query_dim, heads, dim_head, added_kv_proj_dim, attn_mode="torch", split_attn=False, eps=1e-6):
        super().__init__()
        self.heads, self.attn_mode, self.split_attn = heads, attn_mode, split_attn
        self.inner_dim = heads * dim_head
        self.to_q = nn.Linear(query_dim, self.inner_dim)
        self.to_k = nn.Linear(query_dim, self.inner_dim)
        self.to_v = nn.Linear(query_dim, self.inner_dim)
        self.norm_q, self.norm_k = nn.RMSNorm(dim_head, eps=eps), nn.RMSNorm(dim_head, eps=eps)
        self.add_k_proj = nn.Linear(added_kv_proj_dim, self.inner_dim)
        self.add_v_proj = nn.Linear(added_kv_proj_dim, self.inner_dim)
        self.add_q_proj = nn.Linear(added_kv_proj_dim, self.inner_dim)
        self.norm_added_q, self.norm_added_k = nn.RMSNorm(dim_head, eps=eps), nn.RMSNorm(dim_head, eps=eps)
        self.to_out = nn.Linear(self.inner_dim, query_dim)
        self.to_add_out = nn.Linear(self.inner_dim, added_kv_proj_dim)

    def forward(
        self,
        hidden_states: torch.FloatTensor,  # Image stream
        encoder_hidden_states: torch.FloatTensor = None,  # Text stream
        encoder_hidden_states_mask: torch.FloatTensor = None,
        attention_mask: Optional[torch.FloatTensor] = None,
        txt_seq_lens: Optional[torch.Tensor] = None,
    ):
        img_query = self.norm_q(self.to_q(hidden_states).unflatten(-1, (self.heads, -1)))
        img_key = self.norm_k(self.to_k(hidden_states).unflatten(-1, (self.heads, -1)))
        img_value = self.to_v(hidden_states).unflatten(-1, (self.heads, -1))
        txt_query = self.norm_added_q(self.add_q_proj(encoder_hidden_states).unflatten(-1, (self.heads, -1)))
        txt_key = self.norm_added_k(self.add_k_proj(encoder_hidden_states).unflatten(-1, (self.heads, -1)))
        txt_value = self.add_v_proj(encoder_hidden_states).unflatten(-1, (self.heads, -1))
        seq_img = img_query.shape[1]

        # Concatenate for joint attention
        # Order: [image, txt]
        joint_query = torch.cat([img_query, txt_query], dim=1)
        joint_key = torch.cat([img_key, txt_key], dim=1)
        joint_value = torch.cat([img_value, txt_value], dim=1)

        # Compute joint attention
        if FIXED and not self.split_attn:
            # create attention mask for joint attention
            if encoder_hidden_states_mask is not None:
                attention_mask = torch.cat(
                    [
                        torch.ones((encoder_hidden_states_mask.shape[0], seq_img), dtype=torch.bool),
                        encoder_hidden_states_mask.to(torch.bool),
                    ],
                    dim=1,
                )  # [B, S_img + S_txt]
                attention_mask = attention_mask[:, None, None, :]  # [B, 1, 1, S] for scaled_dot_product_attention
            else:
                attention_mask = None

        total_len = seq_img + txt_seq_lens
        qkv = [joint_query, joint_key, joint_value]
        joint_hidden_states = hunyuan_attention(
            qkv, mode=self.attn_mode, attn_mask=attention_mask, total_len=total_len if self.split_attn else None
        )
        img_attn_output = self.to_out(joint_hidden_states[:, :seq_img, :])
        txt_attn_output = self.to_add_out(joint_hidden_states[:, seq_img:, :])
        return img_attn_output, txt_attn_output


def main():
    torch.manual_seed(0)
    attn = Attention(query_dim=32, heads=4, dim_head=8, added_kv_proj_dim=24, attn_mode="torch", split_attn=False)
    hidden_states = torch.randn(2, 4, 32)  # 2x2 latent patches
    encoder_hidden_states = torch.randn(2, 6, 24)
    txt_seq_lens = torch.tensor([6, 3])
    encoder_hidden_states_mask = (torch.arange(6)[None, :] < txt_seq_lens[:, None]).long()
    with torch.no_grad():
        img_out, txt_out = attn(
            hidden_states,
            encoder_hidden_states,
            encoder_hidden_states_mask=encoder_hidden_states_mask,
            txt_seq_lens=txt_seq_lens,
        )
    print("img_attn_output", tuple(img_out.shape), "sample-1 sum %.5f" % img_out[1].abs().sum())


if __name__ == "__main__":
    main()
