from llmcustoms.cli import main

# Guarded: tokenizing workers start by importing the main module again.
if __name__ == "__main__":
    main()
