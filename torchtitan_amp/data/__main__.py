from torchtitan_amp.data.cli import cli

if __name__ == "__main__":
    cli()
