from metanode.cli import main

main()
