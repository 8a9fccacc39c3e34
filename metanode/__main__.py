from metanode.cli import main

if __name__ == "__main__":  # not when a `spawn` worker process imports it
    main()
