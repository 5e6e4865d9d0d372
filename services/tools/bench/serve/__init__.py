"""`halfmoon bench serve` (cli.py): Halfmoon side by side with llama.cpp, transformers serve or
any OpenAI-compatible URL. workload.py makes the prompts and runs the rounds, systems.py starts
and measures each server, report.py renders the banner and the tables."""
