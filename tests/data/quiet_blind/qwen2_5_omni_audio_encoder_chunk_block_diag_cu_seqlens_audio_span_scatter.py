"""Qwen2.5-Omni audio encoder: per-chunk block-diagonal attention, audio spans in the text.

Follows transformers models/qwen2_5_omni/modeling_qwen2_5_omni.py,
Qwen2_5OmniAudioEncoder.forward and padded_and_mask_function (and the eager path of
Qwen2_5OmniAudioAttention, which turns cu_seqlens into a block-diagonal mask), plus
Qwen2_5OmniThinkerForConditionalGeneration.get_audio_features / masked_scatter of the
audio features into the audio_token_index positions.

Every audio's mel frames are cut into chunks of n_window*2 frames (the last chunk of
each audio is shorter). The chunks are right-padded into one batch for the two convs
(conv1 output is multiplied by the padding mask; conv2 has stride 2), the padded frames
are dropped again with padded_mask_after_cnn, and the remaining tokens of ALL audios
are concatenated. cu_seqlens are the per-CHUNK lengths after the CNN, so a token
attends only to the tokens of its own chunk -- not to the rest of its own audio. That
windowing is what the model was trained with. Each audio's tokens are then average-
pooled by 2, projected, and scattered into its <|AUDIO|> placeholder span.
Check: running each chunk alone through the same convs and layers, without padding or
mask, and pooling per audio gives the same features and the same embedded sequences.
"""
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
DT = torch.float64
MEL, D, HEADS, N_WINDOW, LAYERS, OUT = 6, 16, 2, 4, 2, 12
AUDIO_ID, PAD_ID = 9, 0


def sinusoids(length, channels, max_timescale=10000):
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=DT))
    t = torch.arange(length, dtype=DT)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


def make_params():
    g = lambda *s: torch.randn(*s, dtype=DT) * 0.3
    p = {"conv1": torch.nn.Conv1d(MEL, D, 3, padding=1).to(DT),
         "conv2": torch.nn.Conv1d(D, D, 3, stride=2, padding=1).to(DT),
         "pos": sinusoids(64, D), "proj": g(D, OUT), "layers": []}
    for _ in range(LAYERS):
        p["layers"].append({k: g(D, D) for k in ["q", "k", "v", "o"]} | {"f1": g(D, 2 * D), "f2": g(2 * D, D)})
    return p


def layer(x, L, mask):  # x (T, D); mask (T, T) additive or None
    h = F.layer_norm(x, (D,))
    q, k, v = ((h @ L[n]).view(-1, HEADS, D // HEADS).transpose(0, 1) for n in "qkv")
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    x = x + a.transpose(0, 1).reshape(-1, D) @ L["o"]
    return x + F.gelu(F.layer_norm(x, (D,)) @ L["f1"]) @ L["f2"]


def post(states, p):  # avg_pooler (k=2, s=2), ln_post, proj
    s = F.avg_pool1d(states.transpose(0, 1), 2, stride=2).transpose(0, 1)
    return F.layer_norm(s, (D,)) @ p["proj"]


def audio_encoder(input_features, feature_lens, p):
    chunk_num = torch.ceil(feature_lens / (N_WINDOW * 2)).long()
    chunk_lengths = torch.full((int(chunk_num.sum()),), N_WINDOW * 2, dtype=torch.long)
    tail = F.pad(chunk_num, (1, 0), value=-1).cumsum(0)[1:]
    chunk_lengths[tail] = feature_lens % (N_WINDOW * 2)
    chunk_lengths = torch.where(chunk_lengths == 0, N_WINDOW * 2, chunk_lengths)
    chunks = input_features.split(chunk_lengths.tolist(), dim=1)
    # padded_and_mask_function(..., padding_value=0, padding_side="right")
    max_len = int(chunk_lengths.max())
    padded = torch.stack([F.pad(c, (0, max_len - c.shape[1])) for c in chunks])
    padded_mask = (torch.arange(max_len)[None] < chunk_lengths[:, None]).unsqueeze(1).to(DT)
    after = (chunk_lengths - 1) // 2 + 1
    padded_mask_after_cnn = torch.arange((max_len - 1) // 2 + 1)[None] < after[:, None]
    x = F.gelu(p["conv1"](padded)) * padded_mask
    x = F.gelu(p["conv2"](x)).transpose(1, 2)
    x = x + p["pos"][: x.shape[1]].unsqueeze(0)
    hidden = x[padded_mask_after_cnn]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), padded_mask_after_cnn.sum(1).cumsum(0)])
    T = hidden.shape[0]
    mask = torch.full((T, T), torch.finfo(DT).min, dtype=DT)
    for i in range(1, len(cu)):
        mask[cu[i - 1]:cu[i], cu[i - 1]:cu[i]] = 0
    for L in p["layers"]:
        hidden = layer(hidden, L, mask)
    aftercnn_lens = (feature_lens - 1) // 2 + 1
    return torch.cat([post(s, p) for s in hidden.split(aftercnn_lens.tolist(), 0)])


def reference_one_audio(feat, p):  # each chunk alone, unpadded, no mask
    outs = []
    for c in feat.split(N_WINDOW * 2, dim=1):
        x = F.gelu(p["conv2"](F.gelu(p["conv1"](c[None]))))[0].transpose(0, 1)
        x = x + p["pos"][: x.shape[0]]
        for L in p["layers"]:
            x = layer(x, L, None)
        outs.append(x)
    return post(torch.cat(outs), p)


def main():
    p = make_params()
    feature_lens = torch.tensor([21, 8, 13])
    feats = [torch.randn(MEL, int(n), dtype=DT) for n in feature_lens]
    with torch.no_grad():
        audio_feats = audio_encoder(torch.cat(feats, 1), feature_lens, p)
        ref = [reference_one_audio(f, p) for f in feats]
    n_tok = [r.shape[0] for r in ref]
    d_enc = (audio_feats - torch.cat(ref)).abs().max().item()
    # thinker prompts: sample 0 holds audios 0 and 1, sample 1 holds audio 2; right-padded
    rows = [[1, 4] + [AUDIO_ID] * n_tok[0] + [5] + [AUDIO_ID] * n_tok[1] + [6, 2],
            [1, 7] + [AUDIO_ID] * n_tok[2] + [2]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows])
    emb_table = torch.randn(16, OUT, dtype=DT)
    embeds = emb_table[ids]
    audio_mask = (ids == AUDIO_ID).unsqueeze(-1).expand_as(embeds)
    embeds = embeds.masked_scatter(audio_mask, audio_feats)
    d_emb = max((embeds[0, 2:2 + n_tok[0]] - ref[0]).abs().max().item(),
                (embeds[0, 3 + n_tok[0]:3 + n_tok[0] + n_tok[1]] - ref[1]).abs().max().item(),
                (embeds[1, 2:2 + n_tok[2]] - ref[2]).abs().max().item())
    print(f"audio frames {feature_lens.tolist()} -> audio tokens {n_tok}")
    print(f"max|encoder-per-chunk ref|={d_enc:.2e}  max|scattered spans-ref|={d_emb:.2e}")
    assert d_enc < 1e-12 and d_emb < 1e-12
    print("ok")


if __name__ == "__main__":
    main()
