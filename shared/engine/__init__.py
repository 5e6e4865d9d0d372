"""The inference engine: model runner (tensors) apart from sampling, detokenization and KV codec."""
