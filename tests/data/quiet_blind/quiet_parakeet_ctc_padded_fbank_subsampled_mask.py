"""Correct program (quiet batch quiet-r81b).

Ported from huggingface/transformers @ v5.25.0 (installed copy):
src/transformers/models/parakeet/modeling_parakeet.py (ParakeetEncoderSubsamplingConv2D.forward,
ParakeetEncoder._get_subsampling_output_length / _get_output_attention_mask / forward,
ParakeetEncoderConvolutionModule.forward, ParakeetEncoderAttention.forward, ParakeetForCTC.forward) and
src/transformers/loss/loss_ctc.py (ForCTCLoss).

A tiny Parakeet (NeMo FastConformer) CTC model built from ParakeetEncoderConfig / ParakeetCTCConfig reads a
right-padded batch of log-mel frames with its feature-level `attention_mask` (B, T_feat), as ParakeetProcessor
returns it. The encoder zeroes padded frames after every subsampling Conv2d, shrinks the mask to the subsampled
length, and builds a (B, 1, T, T) boolean mask `mask & mask.T` for the relative-position self-attention; the
convolution module zeroes the padded frames before its depthwise conv. The CTC loss takes the subsampled
lengths from the encoder's output attention_mask and skips labels padded with -100.

Self-check (eval mode): for each utterance run alone without padding, the CTC logits at its real subsampled
frames and the greedy CTC tokens equal the batched run's; the batch loss (reduction "sum") equals the sum of the
per-utterance losses; the encoder's output mask equals the per-utterance frame counts.
"""
import torch
from transformers import ParakeetCTCConfig, ParakeetEncoderConfig, ParakeetForCTC

torch.manual_seed(0)

encoder_config = ParakeetEncoderConfig(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    conv_kernel_size=5,
    subsampling_factor=4,
    subsampling_conv_channels=8,
    num_mel_bins=16,
    dropout=0.0,
    dropout_positions=0.0,
    layerdrop=0.0,
    activation_dropout=0.0,
    attention_dropout=0.0,
    max_position_embeddings=256,
)
config = ParakeetCTCConfig(
    vocab_size=12,
    pad_token_id=11,  # the CTC blank
    ctc_loss_reduction="sum",
    ctc_zero_infinity=False,
    encoder_config=encoder_config.to_dict(),
)
model = ParakeetForCTC(config).eval()

# Three utterances of different lengths, right-padded as the feature extractor does.
feat_lengths = [61, 37, 50]
transcripts = [[3, 4, 5, 6, 2], [7, 1, 8], [2, 2, 9, 10]]
T = max(feat_lengths)
B = len(feat_lengths)
utterances = [torch.randn(n, encoder_config.num_mel_bins) for n in feat_lengths]

input_features = torch.zeros(B, T, encoder_config.num_mel_bins)
attention_mask = torch.zeros(B, T, dtype=torch.long)
for i, (x, n) in enumerate(zip(utterances, feat_lengths)):
    input_features[i, :n] = x
    attention_mask[i, :n] = 1

U = max(len(t) for t in transcripts)
labels = torch.full((B, U), -100, dtype=torch.long)
for i, t in enumerate(transcripts):
    labels[i, : len(t)] = torch.tensor(t)

with torch.no_grad():
    out = model(input_features=input_features, attention_mask=attention_mask, labels=labels)
    enc = model.encoder(input_features=input_features, attention_mask=attention_mask, output_attention_mask=True)
    frame_mask = enc.attention_mask.bool()
    frame_lengths = frame_mask.sum(-1).tolist()

    total = 0.0
    for i, (x, t) in enumerate(zip(utterances, transcripts)):
        ref = model(
            input_features=x[None], attention_mask=torch.ones(1, x.shape[0], dtype=torch.long), labels=torch.tensor([t])
        )
        n_frames = ref.logits.shape[1]
        assert frame_lengths[i] == n_frames, (i, frame_lengths[i], n_frames)
        assert bool(frame_mask[i, :n_frames].all()) and not bool(frame_mask[i, n_frames:].any())
        torch.testing.assert_close(out.logits[i, :n_frames], ref.logits[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(out.logits[i, :n_frames].argmax(-1), ref.logits[0].argmax(-1))
        total = total + ref.loss

    torch.testing.assert_close(out.loss, total, rtol=1e-4, atol=1e-4)

print("parakeet ctc: padded batch == per-utterance runs; frames", frame_lengths, "loss", round(float(out.loss), 4))
