# Correct program (quiet batch quiet-r72a).
# Citation: huggingface/transformers v5.25.0 (installed),
#   src/transformers/models/speech_to_text/modeling_speech_to_text.py
#   (Conv1dSubsampler, Speech2TextPreTrainedModel._get_feat_extract_output_lengths /
#   _get_feature_vector_attention_mask, Speech2TextEncoder.forward, Speech2TextDecoder.forward,
#   Speech2TextForConditionalGeneration.forward with labels -> shift_tokens_right) and
#   feature_extraction_speech_to_text.py (right padding of the fbank frames with padding_value 0.0,
#   attention_mask 1 = a real frame); tiny model from Speech2TextConfig, random weights.
# A speech-to-text encoder-decoder (fairseq's S2T transformer as transformers ports it): a batch of three
# utterances of 23, 11 and 17 fbank frames, right-padded to 23, with the feature extractor's frame
# attention_mask; the encoder subsamples that mask to its own frame rate; the transcripts are right-padded
# with the pad id, the labels carry -100 at the pads and the decoder gets a decoder_attention_mask.
# Self-check: teacher-forced logits of every real target token, the per-utterance loss, and greedy
# generate() of the batch equal each utterance run alone, unpadded.
# (The subsampler's kernels are (5, 1): with a second kernel wider than 1 the last real frames of a padded
#  utterance would read the first conv's output over padded frames, which an unpadded run zero-pads; that
#  is a property of the convolution front end, not of the masks.)
import sys

import torch
import torch.nn.functional as F
from transformers import Speech2TextConfig, Speech2TextForConditionalGeneration
from transformers.models.speech_to_text.modeling_speech_to_text import shift_tokens_right

torch.manual_seed(0)

config = Speech2TextConfig(
    vocab_size=40,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    num_conv_layers=2,
    conv_kernel_sizes=(5, 1),
    conv_channels=32,
    input_feat_per_channel=8,
    input_channels=1,
    max_source_positions=64,
    max_target_positions=32,
    dropout=0.0,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
    init_std=0.3,
)
model = Speech2TextForConditionalGeneration(config).eval()

PAD = config.pad_token_id
EOS = config.eos_token_id
frame_lengths = [23, 11, 17]
utterances = [torch.randn(n, config.input_feat_per_channel) for n in frame_lengths]
transcripts = [[5, 9, 12, 7, 30, EOS], [8, 4, EOS], [11, 22, 6, 17, EOS]]


def pad_features(feats):
    # Speech2TextFeatureExtractor.__call__(padding="longest"): frames right-padded with padding_value=0.0,
    # attention_mask 1 for a real frame.
    T = max(f.shape[0] for f in feats)
    input_features = torch.zeros(len(feats), T, feats[0].shape[1])
    attention_mask = torch.zeros(len(feats), T, dtype=torch.long)
    for b, f in enumerate(feats):
        input_features[b, : f.shape[0]] = f
        attention_mask[b, : f.shape[0]] = 1
    return input_features, attention_mask


def pad_labels(seqs):
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), PAD, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    labels = ids.masked_fill(ids == PAD, -100)
    decoder_input_ids = shift_tokens_right(labels, PAD, config.decoder_start_token_id)
    decoder_attention_mask = (decoder_input_ids != PAD).long()
    # the decoder start token is the eos id (2), not the pad id, so every row's first input is real
    return labels, decoder_input_ids, decoder_attention_mask


# ---- batched, padded run (the way the project runs a batch) ----
input_features, attention_mask = pad_features(utterances)
labels, decoder_input_ids, decoder_attention_mask = pad_labels(transcripts)
with torch.no_grad():
    out = model(
        input_features=input_features,
        attention_mask=attention_mask,
        decoder_input_ids=decoder_input_ids,
        decoder_attention_mask=decoder_attention_mask,
        labels=labels,
    )
    batch_logits = out.logits
    token_nll = F.cross_entropy(
        batch_logits.transpose(1, 2), labels, ignore_index=-100, reduction="none"
    )
    enc_mask = model.model.encoder._get_feature_vector_attention_mask(
        model.model.encoder.conv(input_features).shape[1], attention_mask
    )
    gen = model.generate(
        input_features=input_features,
        attention_mask=attention_mask,
        max_new_tokens=8,
        do_sample=False,
        num_beams=1,
        min_new_tokens=4,
    )

# ---- reference: each utterance alone, unpadded, no masks at all ----
ok = True
sub_lengths = model._get_feat_extract_output_lengths(torch.tensor(frame_lengths))
assert enc_mask.sum(-1).tolist() == sub_lengths.tolist(), (enc_mask, sub_lengths)
for b, (feats, tgt) in enumerate(zip(utterances, transcripts)):
    lab = torch.tensor([tgt])
    dec_in = shift_tokens_right(lab, PAD, config.decoder_start_token_id)
    with torch.no_grad():
        alone = model(input_features=feats[None], decoder_input_ids=dec_in, labels=lab)
        alone_gen = model.generate(
            input_features=feats[None], max_new_tokens=8, do_sample=False, num_beams=1, min_new_tokens=4
        )
    n = len(tgt)
    d = (batch_logits[b, :n] - alone.logits[0]).abs().max().item()
    loss_b = token_nll[b, :n].mean()
    dl = (loss_b - alone.loss).abs().item()
    row = gen[b].tolist()
    ref = alone_gen[0].tolist()
    # the batch's rows that finished early are filled with the pad id after their eos
    row_trim = row[: len(ref)]
    same_gen = row_trim == ref and all(t == PAD for t in row[len(ref):])
    print(f"utt {b}: frames {frame_lengths[b]} -> {sub_lengths[b].item()}  max|dlogit|={d:.2e}  "
          f"|dloss|={dl:.2e}  gen batch={row} alone={ref}")
    ok &= d < 1e-4 and dl < 1e-5 and same_gen

# the batch loss is the mean over the real target tokens only
n_real = sum(len(t) for t in transcripts)
dtot = (out.loss - token_nll.sum() / n_real).abs().item()
ok &= dtot < 1e-5
print("batch loss over real tokens matches:", dtot)
if not ok:
    print("MISMATCH")
    sys.exit(1)
print("OK")
