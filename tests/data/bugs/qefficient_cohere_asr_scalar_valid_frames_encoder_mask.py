# quic/efficient-transformers commit abe7288a1 ("fix(cohere_asr): preserve processor mask through QPC decode"): the
# QPC forward ran the encoder with no padding mask and built the decoder cross-attention mask from one scalar
# `valid_frames // subsampling_factor` for the whole batch, so padded mel frames leaked into both attentions.
import sys

import torch
from transformers import CohereAsrConfig, CohereAsrForConditionalGeneration
from transformers.models.parakeet.configuration_parakeet import ParakeetEncoderConfig

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def get_encoder_output_lengths(model, feature_lengths):
    output_lengths = feature_lengths
    for layer in model.model.encoder.subsampling.layers:
        if isinstance(layer, torch.nn.Conv2d) and layer.stride != (1, 1):
            padding, kernel_size, stride = layer.padding[0], layer.kernel_size[0], layer.stride[0]
            output_lengths = (output_lengths + 2 * padding - kernel_size) // stride + 1
    return output_lengths


def qeff_forward(model, input_features, input_ids, valid_frames=None, feature_lengths=None):
    """QPC-side forward: input_features is (batch, num_mel_bins, feature_len), zero padded to a static length."""
    encoder_input_features = input_features.transpose(1, 2)
    attention_mask = None
    if feature_lengths is not None:
        positions = torch.arange(input_features.shape[2])
        attention_mask = positions.unsqueeze(0) < feature_lengths.unsqueeze(1)
    encoder_outputs = model.model.encoder(encoder_input_features, attention_mask=attention_mask)
    encoder_hidden_states = encoder_outputs.last_hidden_state
    encoder_ctx_len = encoder_hidden_states.shape[1]
    positions = torch.arange(encoder_ctx_len)
    if feature_lengths is not None:
        enc_mask = (positions.unsqueeze(0) < get_encoder_output_lengths(model, feature_lengths).unsqueeze(1)).long()
    else:
        subsampling_factor = model.config.encoder_config.subsampling_factor
        valid_enc_frames = valid_frames // subsampling_factor
        enc_mask = (positions < valid_enc_frames.view(1)).long()
        enc_mask = enc_mask.expand(encoder_hidden_states.shape[0], -1)
    out = model.model.decoder(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states,
                              encoder_attention_mask=enc_mask, use_cache=False)
    return model.proj_out(out.last_hidden_state)


def main():
    enc_cfg = ParakeetEncoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=4, num_mel_bins=16, subsampling_conv_channels=8,
                                    conv_kernel_size=5, max_position_embeddings=256, initializer_range=0.3)
    config = CohereAsrConfig(encoder_config=enc_cfg.to_dict(), vocab_size=40, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                             max_position_embeddings=64, initializer_range=0.3)
    model = CohereAsrForConditionalGeneration(config).eval()

    max_frames = 96  # static feature length of the compiled QPC
    lengths = torch.tensor([96, 41])
    feats = torch.randn(2, config.encoder_config.num_mel_bins, max_frames)
    for b, n in enumerate(lengths.tolist()):
        feats[b, :, n:] = 0.0  # processor zero-pads the shorter clip
    input_ids = torch.tensor([[4, 7, 9], [4, 7, 9]])

    with torch.no_grad():
        if FIXED:
            logits = qeff_forward(model, feats, input_ids, feature_lengths=lengths)
        else:
            logits = qeff_forward(model, feats, input_ids, valid_frames=lengths.max())
        # reference: the short clip alone, unpadded, through the eager HF model
        n = int(lengths[1])
        ref = model(input_features=feats[1:2, :, :n].transpose(1, 2), decoder_input_ids=input_ids[1:2]).logits
    diff = (logits[1] - ref[0]).abs().max().item()
    print(f"fixed={FIXED} max |padded-batch logits - unpadded reference| (short clip) = {diff:.6f}")


if __name__ == "__main__":
    main()
