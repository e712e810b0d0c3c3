# Correct program (quiet batch quiet-r95b).
# Citation: huggingface/transformers v5.25.0 (installed),
#   src/transformers/models/seamless_m4t/modeling_seamless_m4t.py
#   (SeamlessM4TConformerEncoder.forward, SeamlessM4TConformerConvolutionModule.forward,
#   SeamlessM4TConformerAdapterLayer._compute_sub_sample_lengths_from_attention_mask / forward,
#   _compute_new_attention_mask, SeamlessM4TForSpeechToText.forward / generate with tgt_lang,
#   SeamlessM4TDecoder.forward) and feature_extraction_seamless_m4t.py (fbank frames stacked by 2 into
#   160-dim rows, right-padded with padding_value 0.0, attention_mask 1 = a real row); tiny model from
#   SeamlessM4TConfig, random weights.
# Speech-to-text translation (facebook/hf-seamless-m4t-medium's S2TT path, shrunk): a batch of three
# utterances of 28, 12 and 20 stacked fbank rows, right-padded to 28, with the feature extractor's
# attention_mask. The conformer speech encoder (relative position self-attention, depthwise convolution
# module) hides the padded rows; its length adaptor (strided conv, kernel 8 / stride 8) subsamples the
# mask to the adaptor's frame rate, and the text decoder's cross-attention uses that subsampled mask.
# generate(tgt_lang="fra") starts each hypothesis from the target-language id and runs beam search
# (3 beams, no repeated bigram, KV cache; the encoder output and its mask are expanded per beam).
# Self-check: the speech encoder's real adaptor frames, the teacher-forced logits of a shared target
# prefix, and the beam search's best sequences and sequence scores equal each utterance run alone,
# unpadded and with no mask.
# (The lengths are 4 mod 8: the adaptor's last window (padding 4) then ends on the last real row, so it
#  reads no padded row -- its convolution is not masked, a property of the front end, not of the masks.)
import sys

import torch
from transformers import GenerationConfig, SeamlessM4TConfig, SeamlessM4TForSpeechToText

torch.manual_seed(0)

config = SeamlessM4TConfig(
    vocab_size=48,
    t2u_vocab_size=16,
    hidden_size=32,
    encoder_layers=1,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    speech_encoder_layers=2,
    speech_encoder_attention_heads=4,
    speech_encoder_intermediate_size=64,
    feature_projection_input_dim=16,
    position_embeddings_type="relative",
    conv_depthwise_kernel_size=5,
    add_adapter=True,
    adaptor_kernel_size=8,
    adaptor_stride=8,
    num_adapter_layers=1,
    max_position_embeddings=64,
    max_source_positions=256,
    t2u_encoder_layers=1,
    t2u_decoder_layers=1,
    t2u_encoder_ffn_dim=32,
    t2u_decoder_ffn_dim=32,
    t2u_encoder_attention_heads=2,
    t2u_decoder_attention_heads=2,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=3,
    decoder_start_token_id=3,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    speech_encoder_dropout=0.0,
    adaptor_dropout=0.0,
    encoder_layerdrop=0.0,
    decoder_layerdrop=0.0,
    speech_encoder_layerdrop=0.0,
)
model = SeamlessM4TForSpeechToText(config).eval()
# Random weights with enough spread that the translation depends on the audio.
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 0.35)

# The checkpoint's generation config maps a target language to its text decoder id.
TGT_LANG_ID = 7
model.generation_config = GenerationConfig(
    decoder_start_token_id=3,
    bos_token_id=2,
    eos_token_id=3,
    pad_token_id=0,
    text_decoder_lang_to_code_id={"fra": TGT_LANG_ID, "eng": 8},
)

# SeamlessM4TFeatureExtractor's output, shrunk: stacked fbank rows, right-padded with 0.0, mask 1 = real.
lengths = [28, 12, 20]
feat_dim = config.feature_projection_input_dim
utterances = [torch.randn(n, feat_dim) for n in lengths]
T = max(lengths)
input_features = torch.zeros(len(lengths), T, feat_dim)
attention_mask = torch.zeros(len(lengths), T, dtype=torch.long)
for i, u in enumerate(utterances):
    input_features[i, : len(u)] = u
    attention_mask[i, : len(u)] = 1

gen_kwargs = dict(
    tgt_lang="fra",
    num_beams=3,
    max_new_tokens=8,
    min_new_tokens=8,
    early_stopping=True,
    no_repeat_ngram_size=2,
    do_sample=False,
    return_dict_in_generate=True,
    output_scores=True,
)

with torch.no_grad():
    enc = model.speech_encoder(input_features=input_features, attention_mask=attention_mask).last_hidden_state
    sub_lens = model._compute_sub_sample_lengths_from_attention_mask(attention_mask).long()

    # A target prefix shared by all utterances: [decoder start, lang id, tokens...].
    prefix = torch.tensor([[config.decoder_start_token_id, TGT_LANG_ID, 11, 23, 5, 40, 17]])
    tf_logits = model(
        input_features=input_features,
        attention_mask=attention_mask,
        decoder_input_ids=prefix.expand(len(lengths), -1),
        use_cache=False,
    ).logits

    out = model.generate(input_features, attention_mask=attention_mask, **gen_kwargs)

    for i, u in enumerate(utterances):
        x = u[None]
        enc_i = model.speech_encoder(input_features=x).last_hidden_state
        n = int(sub_lens[i])
        assert enc_i.shape[1] == n, (enc_i.shape, n)
        torch.testing.assert_close(enc[i, :n], enc_i[0], atol=1e-4, rtol=1e-4)

        logits_i = model(input_features=x, decoder_input_ids=prefix, use_cache=False).logits
        torch.testing.assert_close(tf_logits[i], logits_i[0], atol=1e-4, rtol=1e-4)

        out_i = model.generate(x, **gen_kwargs)
        assert torch.equal(out.sequences[i], out_i.sequences[0]), (out.sequences[i], out_i.sequences[0])
        torch.testing.assert_close(out.sequences_scores[i], out_i.sequences_scores[0], atol=1e-4, rtol=1e-4)

print("adaptor lengths:", sub_lens.tolist())
print("beam search sequences:", out.sequences.tolist())
print("ok")
sys.exit(0)
