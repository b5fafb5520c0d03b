import transformers
from transformers.models.deberta_v2.tokenization_deberta_v2 import DebertaV2Tokenizer
vocab = [("[PAD]", 0.0), ("[UNK]", 0.0), ("[CLS]", 0.0), ("[SEP]", 0.0), ("[MASK]", 0.0), ("▁hi", -1.0), ("▁there", -1.0)]
tok = DebertaV2Tokenizer(vocab=vocab)
ids = tok("hi there")["input_ids"]
print(transformers.__version__, "RESULT ids", ids, tok.convert_ids_to_tokens(ids), "cls/sep ids", tok.cls_token_id, tok.sep_token_id)
