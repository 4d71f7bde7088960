from llmcustoms.cli import main

main()
