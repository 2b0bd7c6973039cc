from worker.process import main

main()
