# Citation: huggingface/transformers src/transformers/models/wav2vec2/modeling_wav2vec2.py
#   (Wav2Vec2Model._get_feature_vector_attention_mask, Wav2Vec2Encoder.forward, Wav2Vec2ForCTC.forward).
# Raw waveforms of different lengths are right-padded with zeros; the sample-level attention_mask (0/1 ints) is
# reduced to the conv frame rate by _get_feature_vector_attention_mask (the frame at each output length - 1 is set
# and a flipped cumsum fills the rest), padded frames are zeroed and the 2D mask becomes the encoder's
# bidirectional padding mask (SDPA). CTC input_lengths come from the same mask, so padded frames never count.
import torch
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

torch.manual_seed(0)
config = Wav2Vec2Config(vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, conv_dim=(16, 16, 16), conv_stride=(5, 4, 2), conv_kernel=(10, 4, 2),
                        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, feat_extract_norm="layer",
                        do_stable_layer_norm=True, mask_time_prob=0.0, pad_token_id=0, ctc_loss_reduction="mean",
                        attn_implementation="sdpa")
model = Wav2Vec2ForCTC(config)
lengths = [1600, 1120, 640]
input_values = torch.zeros(3, max(lengths))
attention_mask = torch.zeros(3, max(lengths), dtype=torch.long)
for i, n in enumerate(lengths):
    wav = torch.randn(n)
    input_values[i, :n] = (wav - wav.mean()) / (wav.std() + 1e-7)   # Wav2Vec2FeatureExtractor do_normalize
    attention_mask[i, :n] = 1
labels = torch.full((3, 6), -100)
for i, L in enumerate([6, 4, 2]):
    labels[i, :L] = torch.randint(1, 12, (L,))
model.train()
out = model(input_values, attention_mask=attention_mask, labels=labels)
out.loss.backward()
frames = model._get_feat_extract_output_lengths(attention_mask.sum(-1))
print("frames", frames.tolist(), "ctc loss %.4f" % out.loss.item())
