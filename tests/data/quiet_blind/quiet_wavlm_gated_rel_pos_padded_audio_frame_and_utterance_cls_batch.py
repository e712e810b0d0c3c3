# Correct program (quiet batch quiet-r165a).
#
# Citation: huggingface/transformers v5.25.0 (installed release), src/transformers/models/wavlm/modeling_wavlm.py:
# WavLMModel.forward, WavLMPreTrainedModel._get_feature_vector_attention_mask / _get_feat_extract_output_lengths,
# WavLMEncoderStableLayerNorm.forward (padded frames zeroed before the positional conv), WavLMAttention
# (compute_bias / _relative_positions_bucket, the gated relative position bias handed to
# F.multi_head_attention_forward as attn_mask, the frame mask as key_padding_mask = attention_mask.ne(1)),
# WavLMForAudioFrameClassification.forward (a label per frame, as speaker diarization uses it) and
# WavLMForSequenceClassification.forward (mean pooling over the frame mask); the processor's padding is
# Wav2Vec2FeatureExtractor (padding="longest", return_attention_mask=True, per-clip zero-mean unit-variance).
# Config laid out as microsoft/wavlm-large is (feat_extract_norm="layer", do_stable_layer_norm=True: the
# checkpoints that are meant to be given an attention_mask), at tiny sizes.
#
# Three clips of 1000, 1400 and 700 samples are right padded into one batch and run through frame
# classification and utterance classification heads. The sample mask becomes a frame mask from the
# conv stack's output lengths; the encoder zeroes padded frames, masks them as keys in every layer (the
# relative position bias of layer 0, gated per query by each layer, is added as a float attn_mask), and the
# utterance head pools over each clip's own frames only. Every clip's real frames, frame logits and
# utterance logits equal the clip run alone (unpadded) and a hand-written single-clip WavLM forward.
import math

import numpy as np
import torch
import torch.nn.functional as F
from transformers import (
    Wav2Vec2FeatureExtractor,
    WavLMConfig,
    WavLMForAudioFrameClassification,
    WavLMForSequenceClassification,
)

torch.manual_seed(0)
np.random.seed(0)

config = WavLMConfig(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    conv_dim=(16, 16, 16),
    conv_stride=(5, 2, 2),
    conv_kernel=(10, 3, 3),
    conv_bias=True,
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
    feat_extract_norm="layer",
    do_stable_layer_norm=True,
    num_buckets=16,
    max_bucket_distance=40,
    use_weighted_layer_sum=True,
    classifier_proj_size=24,
    num_labels=5,
    mask_time_prob=0.0,
    layerdrop=0.0,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    feat_proj_dropout=0.0,
    final_dropout=0.0,
)

frame_cls = WavLMForAudioFrameClassification(config).double().eval()
seqcls = WavLMForSequenceClassification(config).double().eval()
with torch.no_grad():
    # make the gate and the relative bias matter at this size
    for layer in frame_cls.wavlm.encoder.layers:
        layer.attention.gru_rel_pos_const.copy_(1.0 + 0.5 * torch.randn_like(layer.attention.gru_rel_pos_const))
    frame_cls.wavlm.encoder.layers[0].attention.rel_attn_embed.weight.normal_(0.0, 1.0)
    for head in (frame_cls, seqcls):
        head.layer_weights.copy_(torch.randn(config.num_hidden_layers + 1))
        head.classifier.weight.normal_(0.0, 0.5)
    seqcls.projector.weight.normal_(0.0, 0.5)
seqcls.wavlm.load_state_dict(frame_cls.wavlm.state_dict())

processor = Wav2Vec2FeatureExtractor(
    feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True, return_attention_mask=True
)

lengths = [1000, 1400, 700]
clips = [np.random.randn(n).astype(np.float32) * 0.3 + 0.05 for n in lengths]

batch = processor(clips, sampling_rate=16000, padding="longest", return_tensors="pt")
input_values = batch["input_values"].double()
attention_mask = batch["attention_mask"]

with torch.no_grad():
    b_fr = frame_cls(input_values, attention_mask=attention_mask)
    b_sc = seqcls(input_values, attention_mask=attention_mask)
    b_base = frame_cls.wavlm(input_values, attention_mask=attention_mask)


# ----- hand-written single-clip reference (no padding, so no mask) -----

def n_frames(n):
    for k, s in zip(config.conv_kernel, config.conv_stride):
        n = (n - k) // s + 1
    return n


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def bucket(rel):
    half = config.num_buckets // 2
    out = half if rel > 0 else 0
    n = abs(rel)
    max_exact = half // 2
    if n < max_exact:
        return out + n
    large = max_exact + math.log(n / max_exact) / math.log(config.max_bucket_distance / max_exact) * (half - max_exact)
    return out + min(int(large), half - 1)


def ref_wavlm(sd, wave):
    """Returns the hidden states list (input of layer 0, output of each layer) and the final state, (T, C)."""
    x = wave[None, None, :]
    for i in range(len(config.conv_dim)):
        x = F.conv1d(x, sd[f"feature_extractor.conv_layers.{i}.conv.weight"],
                     sd[f"feature_extractor.conv_layers.{i}.conv.bias"], stride=config.conv_stride[i])
        x = layer_norm(x.transpose(1, 2), sd[f"feature_extractor.conv_layers.{i}.layer_norm.weight"],
                       sd[f"feature_extractor.conv_layers.{i}.layer_norm.bias"], 1e-5).transpose(1, 2)
        x = gelu(x)
    x = x[0].T  # (T, C)
    x = layer_norm(x, sd["feature_projection.layer_norm.weight"], sd["feature_projection.layer_norm.bias"],
                   config.layer_norm_eps)
    x = x @ sd["feature_projection.projection.weight"].T + sd["feature_projection.projection.bias"]
    T, C = x.shape

    g = sd["encoder.pos_conv_embed.conv.parametrizations.weight.original0"]
    v = sd["encoder.pos_conv_embed.conv.parametrizations.weight.original1"]
    w = g * v / v.pow(2).sum(dim=(0, 1), keepdim=True).sqrt()
    K = config.num_conv_pos_embeddings
    pos = F.conv1d(x.T[None], w, sd["encoder.pos_conv_embed.conv.bias"], padding=K // 2,
                   groups=config.num_conv_pos_embedding_groups)[0]
    pos = pos[:, :T]  # even kernel: one frame dropped at the end
    x = x + gelu(pos.T)

    H = config.num_attention_heads
    hd = C // H
    rel = torch.tensor([[bucket(j - i) for j in range(T)] for i in range(T)])
    pos_bias = sd["encoder.layers.0.attention.rel_attn_embed.weight"][rel].permute(2, 0, 1)  # (H, T, T)

    hidden = [x]
    for li in range(config.num_hidden_layers):
        p = f"encoder.layers.{li}."
        h = layer_norm(x, sd[p + "layer_norm.weight"], sd[p + "layer_norm.bias"], config.layer_norm_eps)
        # gate from the (normed) query frame, per head
        gh = h.view(T, H, hd).permute(1, 0, 2)
        proj = gh @ sd[p + "attention.gru_rel_pos_linear.weight"].T + sd[p + "attention.gru_rel_pos_linear.bias"]
        proj = proj.view(H, T, 2, 4).sum(-1)
        ga, gb = torch.sigmoid(proj).unbind(-1)
        gate = ga * (gb * sd[p + "attention.gru_rel_pos_const"].view(H, 1) - 1.0) + 2.0  # (H, T)
        q = (h @ sd[p + "attention.q_proj.weight"].T + sd[p + "attention.q_proj.bias"]).view(T, H, hd)
        k = (h @ sd[p + "attention.k_proj.weight"].T + sd[p + "attention.k_proj.bias"]).view(T, H, hd)
        vv = (h @ sd[p + "attention.v_proj.weight"].T + sd[p + "attention.v_proj.bias"]).view(T, H, hd)
        out = torch.zeros(T, H, hd, dtype=x.dtype)
        for hh in range(H):
            # every key of the clip is real: a plain softmax over all of them, per query row
            s = (q[:, hh] @ k[:, hh].T) / math.sqrt(hd) + gate[hh][:, None] * pos_bias[hh]
            a = torch.exp(s - s.max(-1, keepdim=True).values)
            a = a / a.sum(-1, keepdim=True)
            out[:, hh] = a @ vv[:, hh]
        attn = out.reshape(T, C) @ sd[p + "attention.out_proj.weight"].T + sd[p + "attention.out_proj.bias"]
        x = x + attn
        f = layer_norm(x, sd[p + "final_layer_norm.weight"], sd[p + "final_layer_norm.bias"], config.layer_norm_eps)
        f = gelu(f @ sd[p + "feed_forward.intermediate_dense.weight"].T + sd[p + "feed_forward.intermediate_dense.bias"])
        x = x + f @ sd[p + "feed_forward.output_dense.weight"].T + sd[p + "feed_forward.output_dense.bias"]
        hidden.append(x)
    final = layer_norm(x, sd["encoder.layer_norm.weight"], sd["encoder.layer_norm.bias"], config.layer_norm_eps)
    return hidden, final


def ref_heads(wave):
    sd = {k: v.detach() for k, v in frame_cls.wavlm.state_dict().items()}
    hidden, final = ref_wavlm(sd, wave)
    # frame classification: weighted layer sum, a label per frame
    wts = torch.softmax(frame_cls.layer_weights.detach(), 0)
    hs = sum(wts[i] * hidden[i] for i in range(len(hidden)))
    fr_logits = hs @ frame_cls.classifier.weight.T + frame_cls.classifier.bias
    # sequence classification: its own layer weights, projector, mean over all of the clip's frames
    wts = torch.softmax(seqcls.layer_weights.detach(), 0)
    hs = sum(wts[i] * hidden[i] for i in range(len(hidden)))
    pooled = (hs @ seqcls.projector.weight.T + seqcls.projector.bias).mean(0)
    sc_logits = pooled @ seqcls.classifier.weight.T + seqcls.classifier.bias
    return final, fr_logits, sc_logits


def close(a, b, tol=1e-9):
    return torch.allclose(a, b, atol=tol, rtol=0)


frame_mask = frame_cls._get_feature_vector_attention_mask(b_base.last_hidden_state.shape[1], attention_mask)
ok = True
with torch.no_grad():
    for i, wave in enumerate(clips):
        T = n_frames(lengths[i])
        assert int(frame_mask[i].sum()) == T and bool(frame_mask[i, :T].all())
        one = processor([wave], sampling_rate=16000, return_tensors="pt")
        iv = one["input_values"].double()
        assert iv.shape[1] == lengths[i] and close(iv[0], input_values[i, :lengths[i]], 1e-6)
        a_fr = frame_cls(iv, attention_mask=one["attention_mask"])
        a_sc = seqcls(iv, attention_mask=one["attention_mask"])
        a_base = frame_cls.wavlm(iv, attention_mask=one["attention_mask"])
        r_final, r_fr, r_sc = ref_heads(iv[0])

        checks = {
            "frames vs alone": close(b_base.last_hidden_state[i, :T], a_base.last_hidden_state[0]),
            "frames vs hand": close(b_base.last_hidden_state[i, :T], r_final),
            "alone vs hand": close(a_base.last_hidden_state[0], r_final),
            "frame logits vs alone": close(b_fr.logits[i, :T], a_fr.logits[0]),
            "frame logits vs hand": close(b_fr.logits[i, :T], r_fr),
            "seqcls logits vs alone": close(b_sc.logits[i], a_sc.logits[0]),
            "seqcls logits vs hand": close(b_sc.logits[i], r_sc),
        }
        print(f"clip {i}: {lengths[i]} samples, {T} frames:",
              ", ".join(f"{k}={'ok' if v else 'MISMATCH'}" for k, v in checks.items()))
        ok &= all(checks.values())

print("frame logits, first frame:", b_fr.logits[:, 0])
print("seqcls logits:", b_sc.logits)
assert ok, "batched padded WavLM differs from the clips run alone"
print("OK")
