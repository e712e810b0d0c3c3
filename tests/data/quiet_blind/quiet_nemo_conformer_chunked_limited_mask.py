# Citation: NVIDIA/NeMo nemo/collections/asr/modules/conformer_encoder.py (ConformerEncoder._create_masks,
#   att_context_style="chunked_limited") and nemo/collections/asr/parts/submodules/multi_head_attention.py
#   (MultiHeadAttention.forward_attention, INF_VAL = 10000.0).
# Cache-aware streaming Conformer: att_context_size=[left, right] -> chunks of right+1 frames, each chunk sees itself
# and left//chunk_size previous chunks. The mask is a bool BLOCK mask (~keep) combined with the right-padding mask on
# both queries and keys, so padded query rows are fully blocked on purpose: scores get -10000, softmax, then the
# probabilities are zeroed with masked_fill(mask, 0.0); padded outputs are also ignored downstream via pad_mask.
import math
import torch
import torch.nn as nn

torch.manual_seed(0)
INF_VAL = 10000.0


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate, max_cache_len=0):
        super().__init__()
        self.cache_drop_size = None
        self.d_k = n_feat // n_head
        self.s_d_k = math.sqrt(self.d_k)
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)
        self._max_cache_len = max_cache_len

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1)  # (batch, 1, time1, time2)
            scores = scores.masked_fill(mask, -INF_VAL)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)  # (batch, head, time1, time2)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).reshape(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask, pos_emb=None, cache=None):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.s_d_k
        out = self.forward_attention(v, scores, mask)
        return out


class ConformerLayer(nn.Module):
    def __init__(self, d_model, d_ff, n_heads, dropout_att=0.1):
        super().__init__()
        self.fc_factor = 0.5
        self.norm_feed_forward1 = nn.LayerNorm(d_model)
        self.feed_forward1 = nn.Sequential(nn.Linear(d_model, d_ff), nn.SiLU(), nn.Linear(d_ff, d_model))
        self.norm_self_att = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(n_head=n_heads, n_feat=d_model, dropout_rate=dropout_att)
        self.norm_feed_forward2 = nn.LayerNorm(d_model)
        self.feed_forward2 = nn.Sequential(nn.Linear(d_model, d_ff), nn.SiLU(), nn.Linear(d_ff, d_model))
        self.norm_out = nn.LayerNorm(d_model)

    def forward(self, x, att_mask=None, pos_emb=None, pad_mask=None):
        residual = x
        x = self.norm_feed_forward1(x)
        x = self.feed_forward1(x)
        residual = residual + x * self.fc_factor
        x = self.norm_self_att(residual)
        x = self.self_attn(query=x, key=x, value=x, mask=att_mask, pos_emb=pos_emb)
        residual = residual + x
        x = self.norm_feed_forward2(residual)
        x = self.feed_forward2(x)
        residual = residual + x * self.fc_factor
        return self.norm_out(residual)


class ConformerEncoder(nn.Module):
    def __init__(self, feat_in=20, d_model=32, n_heads=4, n_layers=2, att_context_size=(8, 3),
                 att_context_style="chunked_limited", self_attention_model="abs_pos"):
        super().__init__()
        self.pre_encode = nn.Linear(feat_in, d_model)
        self.layers = nn.ModuleList([ConformerLayer(d_model, 4 * d_model, n_heads) for _ in range(n_layers)])
        self.att_context_size = list(att_context_size)
        self.att_context_style = att_context_style
        self.self_attention_model = self_attention_model
        self.use_pad_mask = True

    def _create_masks(self, att_context_size, padding_length, max_audio_length, offset, device):
        if self.self_attention_model != "rel_pos_local_attn":
            att_mask = torch.ones(1, max_audio_length, max_audio_length, dtype=torch.bool, device=device)

            if self.att_context_style == "regular":
                if att_context_size[0] >= 0:
                    att_mask = att_mask.triu(diagonal=-att_context_size[0])
                if att_context_size[1] >= 0:
                    att_mask = att_mask.tril(diagonal=att_context_size[1])
            elif self.att_context_style == "chunked_limited":
                # When right context is unlimited, just the left side of the masking need to get updated
                if att_context_size[1] == -1:
                    if att_context_size[0] >= 0:
                        att_mask = att_mask.triu(diagonal=-att_context_size[0])
                else:
                    chunk_size = att_context_size[1] + 1
                    # left_chunks_num specifies the number of chunks to be visible by each chunk on the left side
                    if att_context_size[0] >= 0:
                        left_chunks_num = att_context_size[0] // chunk_size
                    else:
                        left_chunks_num = 10000

                    chunk_idx = torch.arange(0, max_audio_length, dtype=torch.int, device=att_mask.device)
                    chunk_idx = torch.div(chunk_idx, chunk_size, rounding_mode="trunc")
                    diff_chunks = chunk_idx.unsqueeze(1) - chunk_idx.unsqueeze(0)
                    chunked_limited_mask = torch.logical_and(
                        torch.le(diff_chunks, left_chunks_num), torch.ge(diff_chunks, 0)
                    )
                    att_mask = torch.logical_and(att_mask, chunked_limited_mask.unsqueeze(0))
        else:
            att_mask = None

        # pad_mask is the masking to be used to ignore paddings
        pad_mask = torch.arange(0, max_audio_length, device=device).expand(
            padding_length.size(0), -1
        ) < padding_length.unsqueeze(-1)

        if offset is not None:
            pad_mask_off = torch.arange(0, max_audio_length, device=device).expand(
                padding_length.size(0), -1
            ) >= offset.unsqueeze(-1)
            pad_mask = pad_mask_off.logical_and(pad_mask)

        if att_mask is not None:
            # pad_mask_for_att_mask is the mask which helps to ignore paddings
            pad_mask_for_att_mask = pad_mask.unsqueeze(1).repeat([1, max_audio_length, 1])
            pad_mask_for_att_mask = torch.logical_and(pad_mask_for_att_mask, pad_mask_for_att_mask.transpose(1, 2))
            # att_mask is the masking to be used by the MHA layers to ignore the tokens not supposed to be visible
            att_mask = att_mask[:, :max_audio_length, :max_audio_length]
            # paddings should also get ignored, so pad_mask_for_att_mask is used to ignore their corresponding scores
            att_mask = torch.logical_and(pad_mask_for_att_mask, att_mask.to(pad_mask_for_att_mask.device))
            att_mask = ~att_mask

        pad_mask = ~pad_mask
        return pad_mask, att_mask

    def forward(self, audio_signal, length):
        audio_signal = self.pre_encode(audio_signal.transpose(1, 2))  # (B, T, D)
        max_audio_length = audio_signal.size(1)
        pad_mask, att_mask = self._create_masks(att_context_size=self.att_context_size, padding_length=length,
                                                max_audio_length=max_audio_length, offset=None,
                                                device=audio_signal.device)
        for layer in self.layers:
            audio_signal = layer(x=audio_signal, att_mask=att_mask, pad_mask=pad_mask)
        return audio_signal.transpose(1, 2), length


encoder = ConformerEncoder()
ctc_head = nn.Conv1d(32, 11, kernel_size=1)
audio = torch.randn(3, 20, 30)  # (B, feat, T)
length = torch.tensor([30, 21, 9])
targets = torch.randint(1, 11, (3, 5))
target_lengths = torch.tensor([5, 4, 2])
opt = torch.optim.Adam(list(encoder.parameters()) + list(ctc_head.parameters()), lr=1e-3)
for step in range(2):
    enc, enc_len = encoder(audio, length)
    log_probs = ctc_head(enc).transpose(1, 2).log_softmax(-1)  # (B, T, V)
    loss = nn.functional.ctc_loss(log_probs.transpose(0, 1), targets, enc_len, target_lengths, blank=0)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"ctc_loss={loss.item():.4f}")
