from lctrain.cli import main

main()
