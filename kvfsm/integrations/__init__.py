"""kvfsm inside serving engines: ``kvfsm.integrations.vllm`` (a scheduler that caps prefix hits
to kvfsm's verdict, and a KV connector on kvfsm's tiers). Importing this package imports no
engine; each integration imports its engine when it is imported itself."""
