from gym_proxy.worker.process import main

main()
