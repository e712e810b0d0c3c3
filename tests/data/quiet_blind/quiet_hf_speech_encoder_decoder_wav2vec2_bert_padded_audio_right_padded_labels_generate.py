"""Speech recognition with a warm-started SpeechEncoderDecoderModel (wav2vec2 "large-lv60" style
encoder: layer-norm conv feature encoder, stable-layer-norm transformer, return_attention_mask=True;
a BERT decoder with cross-attention, enc_to_dec_proj between the two widths), as the Hugging Face
speech-recognition seq2seq example trains it.

Each utterance is normalised alone by the feature extractor; DataCollatorSpeechSeq2SeqWithPadding
zero-pads the raw audio on the right (attention_mask from feature_extractor.pad), pads the
tokenized transcripts on the right and replaces the pads with -100, and cuts the leading [CLS]
(the decoder start). The model derives the frame-level encoder_attention_mask for the decoder's
cross-attention with _get_feature_vector_attention_mask; decoder_input_ids = shift_tokens_right
(labels) with -100 -> pad, and no decoder_attention_mask is passed (right padding under the causal
self-attention). Evaluation generates (greedy and beam search) for the padded batch with its
attention_mask.

Follows huggingface/transformers:
  examples/pytorch/speech-recognition/run_speech_recognition_seq2seq.py
      @01ddc4d5a6d8c584a36275089d090c9e0b7c2cf4 (DataCollatorSpeechSeq2SeqWithPadding,
      prepare_dataset: feature_extractor(sample) per utterance, labels = tokenizer(text).input_ids)
  src/transformers/models/speech_encoder_decoder/modeling_speech_encoder_decoder.py (installed
      5.x: SpeechEncoderDecoderModel.forward, encoder_attention_mask from
      encoder._get_feature_vector_attention_mask, shift_tokens_right, CrossEntropyLoss)
  src/transformers/models/wav2vec2/modeling_wav2vec2.py (Wav2Vec2Model, Wav2Vec2EncoderStableLayerNorm)
  src/transformers/models/bert/modeling_bert.py (BertLMHeadModel as decoder with cross-attention)
Tiny configs, a word-level tokenizer built in memory with a [CLS] $A [SEP] template, float64.
"""
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (BertConfig, SpeechEncoderDecoderConfig, SpeechEncoderDecoderModel,
                          Wav2Vec2Config, Wav2Vec2FeatureExtractor)

torch.manual_seed(0)
np.random.seed(0)
DTYPE = torch.float64

words = ("[PAD] [UNK] [CLS] [SEP] the cat sat on mat a dog ran in park it is raining today hello "
         "world good morning yes no".split())
vocab = {w: i for i, w in enumerate(words)}
backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
backend.post_processor = processors.TemplateProcessing(
    single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                                 cls_token="[CLS]", sep_token="[SEP]")
PAD, CLS, SEP = vocab["[PAD]"], vocab["[CLS]"], vocab["[SEP]"]

feature_extractor = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0,
                                             do_normalize=True, return_attention_mask=True)

encoder_config = Wav2Vec2Config(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), conv_bias=True,
    feat_extract_norm="layer", do_stable_layer_norm=True, num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, vocab_size=len(words))
decoder_config = BertConfig(
    vocab_size=len(words), hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
    max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    is_decoder=True, add_cross_attention=True, pad_token_id=PAD)
config = SpeechEncoderDecoderConfig.from_encoder_decoder_configs(encoder_config, decoder_config)
config.decoder_start_token_id = CLS
config.pad_token_id = PAD
config.eos_token_id = SEP
model = SpeechEncoderDecoderModel(config=config).to(DTYPE).eval()
model.generation_config.decoder_start_token_id = CLS
model.generation_config.pad_token_id = PAD
model.generation_config.eos_token_id = SEP


class DataCollatorSpeechSeq2SeqWithPadding:
    def __init__(self, processor_feature_extractor, processor_tokenizer, decoder_start_token_id):
        self.feature_extractor = processor_feature_extractor
        self.tokenizer = processor_tokenizer
        self.decoder_start_token_id = decoder_start_token_id

    def __call__(self, features):
        input_features = [{"input_values": feature["input_values"]} for feature in features]
        label_features = [{"input_ids": feature["labels"]} for feature in features]
        batch = self.feature_extractor.pad(input_features, return_tensors="pt")
        labels_batch = self.tokenizer.pad(label_features, return_tensors="pt")
        # replace padding with -100 to ignore loss correctly
        labels = labels_batch["input_ids"].masked_fill(labels_batch.attention_mask.ne(1), -100)
        # if bos token is appended in previous tokenization step,
        # cut bos token here as it's append later anyways
        if (labels[:, 0] == self.decoder_start_token_id).all().cpu().item():
            labels = labels[:, 1:]
        batch["labels"] = labels
        return batch


def prepare_dataset(array, text):
    inputs = feature_extractor(array, sampling_rate=16000)
    return {"input_values": inputs.input_values[0], "input_length": len(inputs.input_values[0]),
            "labels": tokenizer(text).input_ids}


lengths = (1600, 4000, 2333, 3170)  # raw samples; 79, 199, 115 and 157 encoder frames
texts = ["the cat sat on the mat", "hello world", "a dog ran in the park it is raining today", "yes"]
dataset = [prepare_dataset(np.random.randn(n).astype(np.float32), t) for n, t in zip(lengths, texts)]
collator = DataCollatorSpeechSeq2SeqWithPadding(feature_extractor, tokenizer, decoder_start_token_id=CLS)
batch = collator(dataset)
batch["input_values"] = batch["input_values"].to(DTYPE)
assert (batch["attention_mask"] == 0).any() and (batch["labels"] == -100).any()

worst = 0.0
with torch.no_grad():
    out = model(**batch)
    enc_mask = model.encoder._get_feature_vector_attention_mask(out.encoder_last_hidden_state.shape[1],
                                                                batch["attention_mask"])
    total, count = 0.0, 0
    for b, item in enumerate(dataset):
        x = torch.tensor(item["input_values"], dtype=DTYPE)[None]
        labels = torch.tensor(item["labels"][1:])[None]  # [CLS] cut, no padding
        ref = model(input_values=x, labels=labels)  # this utterance alone: no attention_mask, no padding
        n_frames = ref.encoder_last_hidden_state.shape[1]
        assert int(enc_mask[b].sum()) == n_frames
        worst = max(worst, (out.encoder_last_hidden_state[b, :n_frames] - ref.encoder_last_hidden_state[0]).abs().max().item())
        n = labels.shape[1]
        worst = max(worst, (out.logits[b, :n] - ref.logits[0]).abs().max().item())
        for t in range(n):
            total += -torch.log_softmax(ref.logits[0, t], -1)[labels[0, t]].item()
            count += 1
    worst = max(worst, abs(out.loss.item() - total / count))

    # predict_with_generate: the padded batch with its attention_mask against each utterance alone
    for num_beams in (1, 2):
        kw = dict(max_new_tokens=7, num_beams=num_beams, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)
        gen = model.generate(batch["input_values"], attention_mask=batch["attention_mask"], **kw)
        for b, item in enumerate(dataset):
            x = torch.tensor(item["input_values"], dtype=DTYPE)[None]
            ref = model.generate(x, **kw)
            r = ref.sequences[0]
            g = gen.sequences[b]
            assert torch.equal(g[:len(r)], r), (num_beams, b, g, r)
            assert (g[len(r):] == PAD).all()
            if num_beams == 1:
                for step in range(len(r) - 1):
                    worst = max(worst, (gen.scores[step][b] - ref.scores[step][0]).abs().max().item())

print(f"max |batched - per-utterance| (encoder frames, logits, loss, greedy scores) = {worst:.2e}")
assert worst < 1e-10, worst
print("ok")
