"""Correct program (quiet batch quiet-r88b).

Ported from huggingface/transformers src/transformers/models/wav2vec2_conformer/modeling_wav2vec2_conformer.py
(installed 5.25.0; the port of fairseq's Wav2Vec2-Conformer, facebook/wav2vec2-conformer-rope-large-960h-ft):
Wav2Vec2ConformerModel.forward (_get_feature_vector_attention_mask), Wav2Vec2ConformerEncoder.forward,
Wav2Vec2ConformerSelfAttention with rotary position embeddings, Wav2Vec2ConformerForCTC.forward.

A batch of raw waveforms is right-padded with zeros and carries a sample-level `attention_mask` (1 = a real
sample).  The model turns it into a frame-level mask through the conv feature extractor's output lengths, zeroes
padded frames before the encoder and hands the frame mask, widened to an additive 4-D mask, to every conformer
self-attention; the CTC head takes its input lengths from the same sample mask and its target lengths from the
labels that are not -100.

Self-check: tiny model from Wav2Vec2ConformerConfig (layer-norm feature extractor, rotary positions, depthwise
conformer kernel 1 so no convolution reads past a clip's last frame, dropout off, eval mode).  Each clip's logits
at its real frames equal the clip run alone with no padding and no mask, and the batch CTC loss (reduction "sum")
equals the sum over clips of torch's ctc_loss on each clip's own log-probs and targets.
"""
import torch
import torch.nn.functional as F
from transformers import Wav2Vec2ConformerConfig, Wav2Vec2ConformerForCTC

torch.manual_seed(0)

config = Wav2Vec2ConformerConfig(
    vocab_size=12,
    pad_token_id=0,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    conv_dim=(16, 16),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
    feat_extract_norm="layer",
    do_stable_layer_norm=True,
    position_embeddings_type="rotary",
    conv_depthwise_kernel_size=1,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    feat_proj_dropout=0.0,
    final_dropout=0.0,
    layerdrop=0.0,
    mask_time_prob=0.0,
    ctc_loss_reduction="sum",
)
model = Wav2Vec2ConformerForCTC(config).eval()

sample_lengths = [400, 250, 330]
clips = [torch.randn(n) for n in sample_lengths]
transcripts = [torch.randint(1, config.vocab_size, (k,)) for k in (6, 3, 5)]

B, max_samples = len(clips), max(sample_lengths)
input_values = torch.zeros(B, max_samples)
attention_mask = torch.zeros(B, max_samples, dtype=torch.long)
labels = torch.full((B, max(len(t) for t in transcripts)), -100, dtype=torch.long)
for b, (clip, text) in enumerate(zip(clips, transcripts)):
    input_values[b, : len(clip)] = clip
    attention_mask[b, : len(clip)] = 1
    labels[b, : len(text)] = text

with torch.no_grad():
    out = model(input_values, attention_mask=attention_mask, labels=labels)

ref_loss = 0.0
for b, (clip, text) in enumerate(zip(clips, transcripts)):
    with torch.no_grad():
        single = model(clip[None]).logits[0]
    frames = single.shape[0]
    torch.testing.assert_close(out.logits[b, :frames], single, atol=1e-4, rtol=1e-4)
    log_probs = F.log_softmax(single, dim=-1)
    ref_loss = ref_loss + F.ctc_loss(
        log_probs[:, None],
        text[None],
        torch.tensor([frames]),
        torch.tensor([len(text)]),
        blank=config.pad_token_id,
        reduction="sum",
        zero_infinity=config.ctc_zero_infinity,
    )

torch.testing.assert_close(out.loss, ref_loss, atol=1e-3, rtol=1e-4)
print("wav2vec2-conformer padded CTC batch matches per-clip runs; loss", float(out.loss))
