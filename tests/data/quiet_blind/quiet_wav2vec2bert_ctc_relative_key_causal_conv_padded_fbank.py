"""transformers Wav2Vec2BertForCTC (w2v-BERT 2.0 / Seamless speech encoder), tiny, built from Wav2Vec2BertConfig.

Follows huggingface/transformers src/transformers/models/wav2vec2_bert/modeling_wav2vec2_bert.py (installed 5.x):
  * SeamlessM4TFeatureExtractor: fbank per utterance, stride-2 frame stacking, right padding, and an
    attention_mask over the STACKED frames (so the model needs no conv-subsampling length formula).
  * Wav2Vec2BertEncoder.forward: padded frames zeroed (masked_fill(~mask)), then create_bidirectional_mask
    -> additive key mask for eager attention with position_embeddings_type="relative_key"
    (left_max_position_embeddings / right_max_position_embeddings clip the distance, asymmetric window
    of relative embeddings, not a hard window).
  * Wav2Vec2BertConvolutionModule.forward: the conformer depthwise conv receives conv_attention_mask and
    zeroes padded frames first; it is causal (left pad kernel-1), so right padding never reaches real frames.
  * add_adapter=False: the adapter's strided conv is not used (its pooling reads past the last real frame).
  * CTC greedy decode over _get_feat_extract_output_lengths(attention_mask.sum(-1)) frames.
Check: the padded batch must equal each utterance alone (no padding, no mask), frame by frame.
"""
import numpy as np
import torch
from transformers import SeamlessM4TFeatureExtractor, Wav2Vec2BertConfig, Wav2Vec2BertForCTC

torch.manual_seed(0)
rng = np.random.default_rng(0)


def main():
    fe = SeamlessM4TFeatureExtractor(feature_size=20, num_mel_bins=20, sampling_rate=16000, stride=2)
    config = Wav2Vec2BertConfig(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        feature_projection_input_dim=fe.feature_size * fe.stride, position_embeddings_type="relative_key",
        left_max_position_embeddings=6, right_max_position_embeddings=2, conv_depthwise_kernel_size=5,
        add_adapter=False, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0,
    )
    config._attn_implementation = "eager"
    model = Wav2Vec2BertForCTC(config).eval()

    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (5200, 2400, 3900)]
    batch = fe(waves, sampling_rate=16000, padding=True, return_attention_mask=True, return_tensors="pt")
    feats, mask = batch["input_features"], batch["attention_mask"]

    with torch.no_grad():
        logits = model(feats, attention_mask=mask).logits
        out_lens = model._get_feat_extract_output_lengths(mask.sum(-1))
    ok = bool(mask[:, 0].all()) and bool((mask.sum(-1) < mask.size(1)).any())  # right padded, some padding
    for i, w in enumerate(waves):
        one = fe([w], sampling_rate=16000, padding=False, return_attention_mask=True, return_tensors="pt")
        n = one["input_features"].shape[1]
        with torch.no_grad():
            lg1 = model(one["input_features"]).logits[0]
        ok &= int(out_lens[i]) == n == int(mask[i].sum())
        ok &= torch.allclose(logits[i, :n], lg1, atol=1e-4)
        hyp_b = torch.unique_consecutive(logits[i, :n].argmax(-1))
        hyp_1 = torch.unique_consecutive(lg1.argmax(-1))
        ok &= torch.equal(hyp_b[hyp_b != 0], hyp_1[hyp_1 != 0])
    ok &= bool(torch.isfinite(logits).all())
    print("stacked frames per utterance:", mask.sum(-1).tolist(), "of", mask.size(1))
    print("padded batch matches each utterance alone:", bool(ok))
    assert ok


if __name__ == "__main__":
    main()
