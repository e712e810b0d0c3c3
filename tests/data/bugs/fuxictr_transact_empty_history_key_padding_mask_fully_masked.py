# FuxiCTR (reczoo/FuxiCTR commit 3a060ba, "Update TransAct with adjust_mask"): TransActTransformer
# passes the raw key_padding_mask to nn.TransformerEncoder, so a user whose behaviors are all padding gets a
# fully masked attention row (output zeroed, target item ignored); adjust_mask was applied only before max pooling.
import random
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
random.seed(0)


class TransActTransformer(nn.Module):
    def __init__(self,
                 transformer_in_dim,
                 dim_feedforward=64,
                 num_heads=1,
                 dropout=0,
                 transformer_layers=1,
                 use_time_window_mask=False,
                 time_window_ms=86400000, # recent 24h
                 first_k_cols=1,
                 concat_max_pool=True):
        super(TransActTransformer, self).__init__()
        self.use_time_window_mask = use_time_window_mask
        self.time_window_ms = time_window_ms
        self.concat_max_pool = concat_max_pool
        self.first_k_cols = first_k_cols
        encoder_layer = nn.TransformerEncoderLayer(
            d_model=transformer_in_dim,
            nhead=num_heads,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            batch_first=True,
        )
        self.transformer_encoder = nn.TransformerEncoder(
            encoder_layer, num_layers=transformer_layers
        )
        if self.concat_max_pool:
            self.out_linear = nn.Linear(transformer_in_dim, transformer_in_dim)

    def forward(self, target_emb, sequence_emb, time_interval_seq=None, mask=None):
        # concat action sequence emb with target emb
        seq_len = sequence_emb.size(1)
        concat_seq_emb = torch.cat([sequence_emb,
                                    target_emb.unsqueeze(1).expand(-1, seq_len, -1)], dim=-1)
        # get sequence mask (1's are masked)
        if FIXED:
            key_padding_mask = self.adjust_mask(mask) # keep the last dim
        else:
            key_padding_mask = mask
        if self.use_time_window_mask and self.training:
            rand_time_window_ms = random.randint(0, self.time_window_ms)
            time_window_mask = (time_interval_seq < rand_time_window_ms)
            key_padding_mask = torch.bitwise_or(key_padding_mask, time_window_mask)
        tfmr_out = self.transformer_encoder(src=concat_seq_emb,
                                            src_key_padding_mask=key_padding_mask)
        tfmr_out = tfmr_out.masked_fill(
            key_padding_mask.unsqueeze(-1).repeat(1, 1, tfmr_out.shape[-1]), 0.
        )
        # process the transformer output
        output_concat = []
        output_concat.append(tfmr_out[:, -self.first_k_cols:].flatten(start_dim=1))
        if self.concat_max_pool:
            # Apply max pooling to the transformer output
            if not FIXED:
                key_padding_mask = self.adjust_mask(key_padding_mask) # keep the last dim
            tfmr_out = tfmr_out.masked_fill(
                key_padding_mask.unsqueeze(-1).repeat(1, 1, tfmr_out.shape[-1]), -1e9
            )
            pooled_out = self.out_linear(tfmr_out.max(dim=1).values)
            output_concat.append(pooled_out)
        return torch.cat(output_concat, dim=-1)

    def adjust_mask(self, mask):
        # make sure not all actions in the sequence are masked
        fully_masked = mask.all(dim=-1)
        mask[fully_masked, -1] = 0
        return mask


# TransAct.forward trimmed to one target/sequence field; sequences are left padded (model docstring)
num_items, emb_dim, seq_len = 30, 8, 6
item_emb = nn.Embedding(num_items, emb_dim, padding_idx=0)
tfmr = TransActTransformer(2 * emb_dim, dim_feedforward=32, num_heads=2, dropout=0,
                           use_time_window_mask=False)
head = nn.Linear(2 * 2 * emb_dim, 1)
tfmr.train()

click_history = torch.tensor([[0, 0, 4, 9, 2, 7],
                              [0, 0, 0, 0, 0, 0],      # new user: empty history
                              [3, 8, 1, 5, 6, 11]])
target = torch.tensor([12, 13, 14])
label = torch.tensor([[1.], [0.], [1.]])

padding_mask = (click_history.long() == 0) # 1's for masked positions
out = tfmr(item_emb(target), item_emb(click_history), mask=padding_mask)
y_pred = torch.sigmoid(head(out))
loss = nn.functional.binary_cross_entropy(y_pred, label)
loss.backward()
nan_grads = sum(int(torch.isnan(p.grad).any()) for p in list(tfmr.parameters()) + list(item_emb.parameters())
                if p.grad is not None)
print("transformer output |first_k col| per user:", [round(v, 5) for v in out[:, :2 * emb_dim].abs().sum(-1).tolist()])
print("loss:", round(loss.item(), 6))
print("parameters with NaN grad after one training step:", nan_grads)
